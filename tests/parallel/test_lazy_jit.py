"""parallel.lazy_jit: Megatron imports without dynamo's backends and inductor on CPU, and a fused kernel
that is called still gets ``torch.compile``'d, with its options, on that first call."""

import subprocess
import sys

from parallel.lazy_jit import compile_on_first_call


def test_a_kernel_compiles_on_its_first_call_with_its_options():
    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    fuser = compile_on_first_call(fake_compile)

    @fuser
    def add(a, b):
        return a + b

    @fuser(dynamic=True)
    def mul(a, b):
        return a * b

    assert calls == [] and add.__name__ == "add"  # nothing compiled at decoration
    assert add(2, 3) == ("compiled", 5) and add(1, 1) == ("compiled", 2)
    assert mul(2, 3) == ("compiled", 6)
    assert calls == [("add", {}), ("mul", {"dynamic": True})]  # once each, with the options


def test_megatron_imports_without_inductor_on_cpu():
    probe = (
        "import sys, torch, parallel, megatron.core.models.gpt, megatron.core.jit as jit;"
        "print(torch.cuda.is_available(), 'torch._inductor.compile_fx' in sys.modules, jit.jit_fuser is torch.compile)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "False"], out.stdout

"""The converters' startup shortcuts give exactly what the slow paths give.

* ``fast_hf_config``: the transformers config of every family (tiny test configs, in the diff form
  ``save_pretrained`` writes, and the full hub shapes ``bench_convert --synth`` uses) equals
  ``load_hf_config``'s field for field, and the ``ModelConfig`` built from it is equal -- computed
  in a fresh interpreter, where the shortcut is what loads the config classes, and without
  importing ``transformers.generation``.
* ``fast_tokenizer_size`` equals ``len(AutoTokenizer.from_pretrained(...))``, and gives up (None)
  where transformers would add a token the ``tokenizer.json`` lacks.
* The driver module imports neither torch nor transformers (the fork server starts first).
* ``TreeMemory`` sees the memory of a child process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_rl.models.families import get_family, load_hf_config  # noqa: E402
from megatron_rl.models.tiny_checkpoints import TINY_HF_CONFIGS  # noqa: E402
from tools.bench_convert import SYNTH_CONFIGS  # noqa: E402
from megatron_rl.convert.support import fast_tokenizer_size  # noqa: E402
from megatron_rl.convert.output import TreeMemory  # noqa: E402

_FRESH = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from megatron_rl.convert.support import fast_hf_config
from megatron_rl.models.families import get_family
out = []
for data in json.loads(sys.stdin.read()):
    cfg = fast_hf_config(data)
    model = get_family(cfg).model_config(cfg)
    out.append({"config": json.loads(cfg.to_json_string(use_diff=False)), "model": repr(model)})
print(json.dumps({"results": out, "generation": "transformers.generation.utils" in sys.modules}))
"""


def _configs() -> list[dict]:
    configs = []
    for family, data in sorted(TINY_HF_CONFIGS.items()):
        full = load_hf_config(dict(data, vocab_size=300))
        configs.append(json.loads(full.to_json_string(use_diff=True)))  # what save_pretrained writes
        configs.append(json.loads(full.to_json_string(use_diff=False)))
    configs += [dict(c) for c in SYNTH_CONFIGS.values()]
    return configs


def test_fast_hf_config_equals_load_hf_config():
    configs = _configs()
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH, str(ROOT)],
        input=json.dumps(configs),
        text=True,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fresh["generation"] is False  # the docstrings' imports were skipped
    assert len(fresh["results"]) == len(configs) >= 2 * len(TINY_HF_CONFIGS) + 2
    for data, got in zip(configs, fresh["results"]):
        cfg = load_hf_config(data)
        assert got["config"] == json.loads(cfg.to_json_string(use_diff=False)), data.get("model_type")
        assert got["model"] == repr(get_family(cfg).model_config(cfg)), data.get("model_type")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_byte_bpe_tokenizer(None, 300, path)
    return path


def test_fast_tokenizer_size_equals_transformers(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    assert fast_tokenizer_size(tokenizer_dir) == len(AutoTokenizer.from_pretrained(tokenizer_dir)) == 300
    # A special token the vocabulary lacks: transformers adds it, the shortcut refuses to guess.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, bos_token="<|new_bos|>")))
    assert fast_tokenizer_size(tmp_path) is None
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 301
    (tmp_path / "tokenizer.json").unlink()
    assert fast_tokenizer_size(tmp_path) is None  # no tokenizer.json: transformers' business


def test_driver_imports_no_torch():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import megatron_rl.convert.hf_to_mcore; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def _hold(nbytes: int, ready, stop) -> None:
    block = bytearray(nbytes)  # touched: every page resident and private
    ready.set()
    stop.wait(30)
    del block


def test_tree_memory_counts_children():
    ctx = mp.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    with TreeMemory(interval=0.05) as memory:
        base = TreeMemory.sample()
        child = ctx.Process(target=_hold, args=(64 * 2**20, ready, stop))
        child.start()
        assert ready.wait(30)
        time.sleep(0.3)
        stop.set()
        child.join(30)
    assert base is not None and memory.peak is not None
    assert memory.peak >= base + 60 * 2**20


def test_fast_encoder_equals_transformers(tokenizer_dir):
    from transformers import AutoTokenizer

    from megatron_rl.convert.support import FastEncoder
    from megatron_rl.convert.verify import VERIFY_PROMPTS

    slow = AutoTokenizer.from_pretrained(tokenizer_dir)
    for prompt in VERIFY_PROMPTS:
        assert FastEncoder(tokenizer_dir).encode(prompt) == slow.encode(prompt, add_special_tokens=False)

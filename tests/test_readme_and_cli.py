"""README's set-up commands, .ci/run and the console script stay consistent and working."""

import re
import subprocess
import sys
from pathlib import Path

import megatron_rl
from megatron_rl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = [
        line.strip() for block in _bash_blocks() for line in block.splitlines() if line.startswith("pip install")
    ]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, f".ci/run must run the README's test command {commands[1]!r}"


def test_cli_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"megatron_rl {megatron_rl.__version__}"


def test_cli_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "version" in out.stdout and "bench" in out.stdout


def test_train_help_names_where_the_keys_are_documented():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    text = " ".join(out.stdout.split())
    assert "docs/reference/configuration.md" in text and "--show-config" in text
    assert (ROOT / "tools" / "gen_config_reference.py").is_file()


def test_train_show_config_prints_the_resolved_config(capsys):
    import yaml

    assert main(["train", "grpo", "--show-config", "trainer.total_training_steps=3"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["trainer"]["total_training_steps"] == 3
    assert resolved["actor_rollout_ref"]["actor"]["rollout_n"] == resolved["actor_rollout_ref"]["rollout"]["n"] == 8


def test_train_show_config_refuses_an_unknown_key(capsys):
    assert main(["train", "grpo", "--show-config", "trainer.total_trainnig_steps=3"]) == 2
    assert "trainer.total_training_steps" in capsys.readouterr().err

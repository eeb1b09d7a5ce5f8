"""Bad input to ``megatron-rl train`` / ``plan``: exit 2, a message naming the key or file, fast, and
nothing changed -- the finished run's ``final_hf/`` (by checksum), checkpoints and metrics, every
file of it, are as they were.

Every case runs ``megatron_rl.cli.main`` in this process (the console script's function, the same
exit code; no interpreter start-up per case) against the finished run's directory -- or a copy
with a damaged checkpoint -- and asserts: the exit code, the message, the time to fail (each is
found before Ray or any worker starts: no "workers started" line, seconds not minutes), and an
unchanged ``snapshot`` of the run directory. One case runs as a subprocess, to show the real
process exit code.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest

from megatron_rl.cli import main
from tests.faults.runs import cli, copy_run, env, fixture_overrides, snapshot

FAIL_FAST_S = 20.0
"""Upper bound of a bad-input case's wall time (imports and config only; a run start-up takes minutes on a cluster)."""
FILES = "data.task=null"
"""Cases that give prompt files instead of the built-in task (the run directory is not resumed: resume_mode=disable)."""


def _rows(n: int, **overrides) -> list[dict]:
    base = {
        "prompt": [{"role": "user", "content": "Reverse: 1 2"}],
        "data_source": "toy_reverse",
        "reward_model": {"style": "rule", "ground_truth": "2 1"},
    }
    return [{**base, **overrides} for _ in range(n)]


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("data_source", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table(), str(path))
    return path


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files(path: Path, *extra: str) -> list[str]:
    return [FILES, f"data.train_files={path}", "trainer.resume_mode=disable", *extra]


@dataclass
class Env:
    """What a case builds on: the finished run, its reward file, a scratch directory."""

    run: Path
    reward: Path
    tmp: Path

    def damaged(self, damage: Callable[[Path], None]) -> Path:
        """A copy of the finished run with ``damage(copy)`` applied."""
        copy = copy_run(self.run, self.tmp / "damaged")
        damage(copy)
        return copy


@dataclass
class Case:
    """``build(env) -> (overrides, expected message part, run directory or None = the finished run)``."""

    build: Callable[[Env], tuple]
    skip: Optional[str] = None


def _reward_file(env: Env, text: str) -> Path:
    path = env.tmp / "bad_reward.py"
    path.write_text(text)
    return path


def _truncate(rel: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        f = run / rel
        f.write_bytes(f.read_bytes()[:1000])

    return damage


def _flip(rel: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        f = run / rel
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        f.write_bytes(bytes(data))

    return damage


def _remove(rel: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        import shutil

        target = run / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    return damage


def _write(rel: str, text: str) -> Callable[[Path], None]:
    return lambda run: (run / rel).write_text(text)


REFUSE = "trainer.resume_fallback=false"
STEP2 = "global_step_2/actor/__0_0.distcp"
LEGACY = "global_step_2/manifest.json"

CASES: dict[str, Case] = {
    # --- the configuration itself -----------------------------------------------------------
    "unknown_key": Case(lambda e: (["trainer.totl_training_steps=3"], "trainer.totl_training_steps", None)),
    "wrong_type": Case(lambda e: (["trainer.save_freq=often"], "trainer.save_freq='often' has the wrong type", None)),
    "rollout_n_zero": Case(
        lambda e: (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n=0 is out of range", None)
    ),
    "invalid_layout": Case(
        lambda e: (
            ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
            "nearest valid layout: actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            None,
        )
    ),
    "invalid_micro_batch": Case(
        lambda e: (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
            "nearest valid layout: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            None,
        )
    ),
    "does_not_fit": Case(
        lambda e: (
            [
                "actor_rollout_ref.model.config.num_layers=64",
                "actor_rollout_ref.model.config.hidden_size=8192",
                "actor_rollout_ref.model.config.ffn_hidden_size=28672",
                "trainer.resume_mode=disable",
            ],
            "GiB are available",
            None,
        )
    ),
    "phase_timeout_negative": Case(
        lambda e: (["trainer.phase_timeout_s=-1"], "trainer.phase_timeout_s=-1.0 is out of range", None)
    ),
    "greedy_with_n8": Case(
        lambda e: (
            ["actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.n=8"],
            "actor_rollout_ref.rollout.temperature=0 (greedy decoding) with actor_rollout_ref.rollout.n=8",
            None,
        )
    ),
    "no_sampling_with_n2": Case(
        lambda e: (
            ["actor_rollout_ref.rollout.do_sample=false"],
            "actor_rollout_ref.rollout.do_sample=False (greedy decoding)",
            None,
        )
    ),
    "greedy_validation_n2": Case(
        lambda e: (
            ["actor_rollout_ref.rollout.val_kwargs.n=2"],
            "actor_rollout_ref.rollout.val_kwargs.temperature=0 (greedy decoding) with "
            "actor_rollout_ref.rollout.val_kwargs.n=2",
            None,
        )
    ),
    "logger_not_installed": Case(
        lambda e: (
            ["trainer.logger=[console,wandb]"],
            "trainer.logger includes 'wandb' but the wandb package is not installed",
            None,
        ),
        skip="wandb is installed" if importlib.util.find_spec("wandb") else None,
    ),
    "run_dir_is_a_file": Case(
        lambda e: ([], "is a file, not a directory", (e.tmp / "a_file").write_text("x") and e.tmp / "a_file")
    ),
    # --- models ---------------------------------------------------------------------------------
    "model_path_missing": Case(
        lambda e: (
            [
                "actor_rollout_ref.model.config=null",
                "actor_rollout_ref.model.path=/nonexistent/model",
                "trainer.sft_warmup_steps=0",
            ],
            "actor_rollout_ref.model.path='/nonexistent/model' does not exist",
            None,
        )
    ),
    "model_path_no_config": Case(
        lambda e: (
            [
                "actor_rollout_ref.model.config=null",
                f"actor_rollout_ref.model.path={e.tmp}",
                "trainer.sft_warmup_steps=0",
            ],
            "holds no config.json",
            None,
        )
    ),
    "model_path_no_weights": Case(
        lambda e: (
            [
                "actor_rollout_ref.model.config=null",
                f"actor_rollout_ref.model.path={_config_only(e.tmp / 'noweights')}",
                "trainer.sft_warmup_steps=0",
            ],
            "holds no *.safetensors weights",
            None,
        )
    ),
    "gpu_recipe_model_missing": Case(
        lambda e: (
            ["--recipe=gpu/qwen3_30b_a3b_grpo"],
            "actor_rollout_ref.model.path='~/models/Qwen3-30B-A3B'",
            e.tmp / "gpu",
        )
    ),
    "tokenizer_path_missing": Case(
        lambda e: (
            ["actor_rollout_ref.model.tokenizer_path=/nonexistent/tok"],
            "actor_rollout_ref.model.tokenizer_path='/nonexistent/tok' is not a directory",
            None,
        )
    ),
    "reward_model_missing": Case(
        lambda e: (
            ["reward.reward_model.enable=true", "reward.reward_model.model_path=/nonexistent/rm"],
            "reward.reward_model.model_path='/nonexistent/rm' does not exist",
            None,
        )
    ),
    # --- the reward -----------------------------------------------------------------------------
    "reward_file_missing": Case(
        lambda e: (
            ["reward.custom_reward_function.path=/nonexistent.py"],
            "reward.custom_reward_function.path='/nonexistent.py' is not a file",
            None,
        )
    ),
    "reward_syntax_error": Case(
        lambda e: (
            [
                f"reward.custom_reward_function.path="
                f"{_reward_file(e, 'def compute_score(a, b, c, d=None):' + chr(10) + '    return (' + chr(10))}"
            ],
            "bad_reward.py:2: ",
            None,
        )
    ),
    "reward_import_error": Case(
        lambda e: (
            [
                f"reward.custom_reward_function.path="
                f"{_reward_file(e, 'import not_a_module_xyz' + chr(10) + 'def compute_score(*a, **k):' + chr(10) + '    return 0.0' + chr(10))}"
            ],
            "importing it raised ModuleNotFoundError: No module named 'not_a_module_xyz' (at ",
            None,
        )
    ),
    "reward_name_missing": Case(
        lambda e: (
            ["reward.custom_reward_function.name=score"],
            "reward.custom_reward_function.name='score' is not a function in",
            None,
        )
    ),
    "reward_fn_unknown": Case(
        lambda e: (
            ["reward.custom_reward_function.path=null", "reward.reward_fn=toy_revers"],
            "reward.reward_fn='toy_revers' is not a registered reward",
            None,
        )
    ),
    # --- data files -----------------------------------------------------------------------------
    "data_file_missing": Case(
        lambda e: (
            _files(Path("/nonexistent.parquet")),
            "data.train_files: data file '/nonexistent.parquet' does not exist",
            None,
        )
    ),
    "data_parquet_no_rows": Case(
        lambda e: (_files(_parquet(e.tmp / "empty.parquet", [])), "empty.parquet' has no rows", None)
    ),
    "data_jsonl_empty": Case(
        lambda e: (_files(_jsonl(e.tmp / "empty.jsonl", [])), "empty.jsonl' is empty (0 bytes)", None)
    ),
    "data_jsonl_bad_json": Case(
        lambda e: (
            _files(_write_lines(e.tmp / "bad.jsonl", [json.dumps(_rows(1)[0]), json.dumps(_rows(1)[0]), "{oops"])),
            "bad.jsonl' line 3: not valid JSON",
            None,
        )
    ),
    "data_jsonl_not_utf8": Case(
        lambda e: (
            _files(
                _bytes(
                    e.tmp / "latin1.jsonl",
                    json.dumps(_rows(1)[0]).encode() + b"\n" + '{"prompt": "caf\u00e9"}'.encode("latin-1") + b"\n",
                )
            ),
            "latin1.jsonl' line 2: not UTF-8 text",
            None,
        )
    ),
    "data_no_prompt_column": Case(
        lambda e: (
            _files(
                _jsonl(
                    e.tmp / "q.jsonl",
                    [{"question": "x", "data_source": "toy_reverse", "reward_model": {"ground_truth": "1"}}],
                )
            ),
            "q.jsonl' line 1 has no field 'prompt'",
            None,
        )
    ),
    "data_no_ground_truth_column": Case(
        lambda e: (
            _files(_jsonl(e.tmp / "g.jsonl", [{"prompt": "x", "data_source": "toy_reverse"}])),
            "g.jsonl' line 1 has no field 'reward_model'",
            None,
        )
    ),
    "data_all_prompts_empty": Case(
        lambda e: (
            _files(_parquet(e.tmp / "blank.parquet", _rows(2, prompt=[{"role": "user", "content": ""}]))),
            "2 of 2 prompts (column 'prompt') are empty (rows 0, 1)",
            None,
        )
    ),
    "data_some_prompts_empty": Case(
        lambda e: (
            _files(_jsonl(e.tmp / "some.jsonl", _rows(2) + _rows(1, prompt="  "))),
            "1 of 3 prompts (column 'prompt') are empty (lines 3)",
            None,
        )
    ),
    "data_unsupported_suffix": Case(
        lambda e: (_files(_write_lines(e.tmp / "data.csv", ["prompt", "x"])), "unsupported format '.csv'", None)
    ),
    "data_path_is_a_directory": Case(
        lambda e: (_files(_mkdir(e.tmp / "dir.parquet")), "dir.parquet' is not a file", None)
    ),
    "data_parquet_garbage": Case(
        lambda e: (
            _files(_bytes(e.tmp / "junk.parquet", b"not parquet at all" * 10)),
            "junk.parquet' is not a readable parquet file",
            None,
        )
    ),
    "data_val_file_missing": Case(
        lambda e: (
            _files(_parquet(e.tmp / "ok.parquet", _rows(4)), "data.val_files=/nonexistent_val.jsonl"),
            "data.val_files: data file '/nonexistent_val.jsonl' does not exist",
            None,
        )
    ),
    "data_batch_larger_than_data": Case(
        lambda e: (
            _files(
                _parquet(e.tmp / "three.parquet", _rows(3)),
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            ),
            "data.train_batch_size=4 is larger than the 3 prompts",
            None,
        )
    ),
    "data_source_without_reward": Case(
        lambda e: (
            _files(
                _parquet(e.tmp / "src.parquet", _rows(4, data_source="mystery")),
                "reward.custom_reward_function.path=null",
            ),
            "has data_source='mystery', for which there is no rule reward",
            None,
        )
    ),
    "data_files_empty_list": Case(
        lambda e: (
            [FILES, "data.train_files=[]", "trainer.resume_mode=disable"],
            "data.train_files=[] names no file",
            None,
        )
    ),
    # --- the checkpoint to resume ---------------------------------------------------------------
    "resume_truncated_distcp": Case(
        lambda e: ([REFUSE], f"{STEP2} has 1000 bytes, the manifest records", e.damaged(_truncate(STEP2)))
    ),
    "resume_flipped_bytes": Case(
        lambda e: ([REFUSE], f"{STEP2} does not match its checksum in manifest.json", e.damaged(_flip(STEP2)))
    ),
    "resume_no_complete_marker": Case(
        lambda e: (
            [REFUSE],
            "global_step_2/actor/megatron_rl_complete.json is missing",
            e.damaged(_remove("global_step_2/actor/megatron_rl_complete.json")),
        )
    ),
    "resume_no_rng_states": Case(
        lambda e: (
            [REFUSE],
            "global_step_2/actor/rng/rank_0.pt is missing",
            e.damaged(_remove("global_step_2/actor/rng")),
        )
    ),
    "resume_garbage_trainer_state": Case(
        lambda e: (
            [REFUSE],
            "global_step_2/trainer_state.json is not a valid trainer state",
            e.damaged(_write("global_step_2/trainer_state.json", "{garbage")),
        )
    ),
    "resume_garbage_pointer": Case(
        lambda e: (
            [REFUSE],
            "latest_checkpointed_iteration.txt holds 'two', not a step number",
            e.damaged(_write("latest_checkpointed_iteration.txt", "two\n")),
        )
    ),
    "resume_legacy_truncated": Case(
        lambda e: (
            [REFUSE],
            f"{STEP2} is truncated: 1000 bytes, its tensors need",
            e.damaged(lambda r: (_remove(LEGACY)(r), _truncate(STEP2)(r))),
        )
    ),
    "resume_all_damaged": Case(
        lambda e: (
            [],
            "no complete checkpoint under",
            e.damaged(lambda r: (_truncate(STEP2)(r), _truncate("global_step_1/actor/__0_0.distcp")(r))),
        )
    ),
    "resume_path_missing": Case(
        lambda e: (
            ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/nonexistent/ckpt"],
            "trainer.resume_from_path='/nonexistent/ckpt' does not exist",
            None,
        )
    ),
    "resume_path_damaged": Case(
        lambda e: (
            ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={e.tmp / 'damaged' / 'global_step_1'}"],
            "global_step_1/actor/__0_0.distcp has 1000 bytes",
            e.damaged(_truncate("global_step_1/actor/__0_0.distcp")),
        )
    ),
    "resume_model_shape_changed": Case(
        lambda e: (
            ["actor_rollout_ref.model.config.hidden_size=256"],
            "actor_rollout_ref.model.config.hidden_size: the model has hidden_size=256 but checkpoint",
            None,
        )
    ),
    "resume_batch_size_changed": Case(
        lambda e: (
            ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            "data.train_batch_size=4 but checkpoint",
            None,
        )
    ),
    "resume_seed_changed": Case(lambda e: (["data.seed=7"], "data.seed=7 but checkpoint", None)),
    "resume_needs_a_critic": Case(lambda e: (["algorithm.adv_estimator=gae"], "trains a critic but checkpoint", None)),
    "resume_fallback_then_bad_reward": Case(
        lambda e: (
            ["reward.custom_reward_function.path=/nonexistent.py"],
            "reward.custom_reward_function.path='/nonexistent.py' is not a file",
            e.damaged(_truncate(STEP2)),
        )
    ),
}


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _config_only(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_fast_and_changes_nothing(name, finished_run, tmp_path, capsys):
    run, reward, _, _ = finished_run
    case = CASES[name]
    if case.skip:
        pytest.skip(case.skip)
    overrides, expected, run_dir = case.build(Env(run, reward, tmp_path))
    run_dir = run if run_dir is None else run_dir
    recipe = "grpo"
    if overrides and overrides[0].startswith("--recipe="):
        recipe, overrides = overrides[0].split("=", 1)[1], overrides[1:]
        args = ["train", recipe, "--no-progress", *overrides, f"trainer.default_local_dir={run_dir}"]
    else:
        args = [
            "train",
            recipe,
            "--no-progress",
            *fixture_overrides(reward),
            *overrides,
            f"trainer.default_local_dir={run_dir}",
        ]
    before, original = (snapshot(run_dir) if run_dir.is_dir() else None), snapshot(run)
    capsys.readouterr()
    start = time.perf_counter()
    rc = main(args)
    seconds = time.perf_counter() - start
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, text[-3000:]
    assert expected in out.err, out.err[-3000:]
    assert "Traceback" not in text
    assert "workers started" not in text and seconds < FAIL_FAST_S, (seconds, text[-2000:])
    assert snapshot(run) == original  # the finished run: final_hf, checkpoints, metrics -- every file
    if before is not None:
        assert snapshot(run_dir) == before  # a damaged copy keeps its damaged checkpoint, nothing replaced
    if name == "resume_fallback_then_bad_reward":  # fell back, said so and named the bad file, then the reward
        assert f"global_step_2 is damaged: {run_dir / STEP2} has 1000 bytes" in out.out
        assert f"resuming from {run_dir / 'global_step_1'}, the newest complete checkpoint" in out.out


def test_the_console_script_exit_code_is_2(finished_run):
    run, reward, _, _ = finished_run
    before = snapshot(run)
    done = subprocess.run(
        cli(
            "train",
            "grpo",
            *fixture_overrides(reward),
            "reward.custom_reward_function.path=/none.py",
            f"trainer.default_local_dir={run}",
        ),
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().endswith(
        "reward.custom_reward_function.path='/none.py' is not a file (it does not exist)"
    )
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--gpu-memory-gb", "-5"], "argument --gpu-memory-gb: '-5' must be a finite number of GiB > 0"),
        (["--gpu-memory-gb", "nan"], "argument --gpu-memory-gb: 'nan' must be a finite number of GiB > 0"),
        (
            ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
            "nearest valid layout: actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        ),
    ],
)
def test_plan_refuses_bad_input_with_exit_2(args, expected, capsys):
    try:
        rc = main(["plan", "grpo", *args])
    except SystemExit as exc:  # argparse's own refusal
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and expected in err, err

"""The ``megatron-rl`` command line: one entry point with subcommands."""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from pathlib import Path

import megatron_rl

TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"
BENCHMARKS = {"algos": "bench_algos.py", "bridge": "bench_bridge.py"}
CONVERTERS = {"hf-to-mcore": "hf_to_mcore", "mcore-to-hf": "mcore_to_hf"}


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"megatron_rl {megatron_rl.__version__}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    script = TOOLS_DIR / BENCHMARKS[args.name]
    if not script.exists():
        print(f"megatron-rl bench: {script} not found (benchmarks run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    # Imported as a module (not run as a script): its rank functions must be importable by name
    # in the processes it spawns.
    tool = importlib.import_module(f"megatron_rl.convert.{CONVERTERS[args.direction]}")
    return tool.main(args.rest, prog=f"megatron-rl convert {args.direction}")


def _cmd_train(args: argparse.Namespace) -> int:
    from megatron_rl.job.main_job import run_train

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and ("=" in recipe or recipe.startswith("~")):  # `train key=value ...`: the default recipe
        recipe, overrides = None, [recipe, *overrides]
    if args.config is not None:  # a verl config file: show which of its keys act before anything starts
        from megatron_rl.config.loader import key_report

        if recipe is not None:
            overrides = [recipe, *overrides]
        recipe = args.config
        try:
            report, refused = key_report(recipe, overrides)
        except ValueError as err:
            print(f"megatron-rl train: {err}", file=sys.stderr)
            return 2
        print(report, flush=True)
        if refused:
            print("megatron-rl train: refused keys (see above); nothing was started", file=sys.stderr)
            return 2
    if args.show_config:
        return _show_config(recipe, overrides)
    return _run_and_exit_code(run_train, recipe, overrides, progress=not args.no_progress)


def _show_config(recipe: str | None, overrides: list[str]) -> int:
    """``train RECIPE --show-config``: the resolved config (recipe + overrides + derived keys) as YAML; nothing runs."""
    from megatron_rl.config.loader import dump_config
    from megatron_rl.job.main_job import load_run_config

    try:
        config, _ = load_run_config(recipe, overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"megatron-rl train: {err}", file=sys.stderr)
        return 2
    print(
        f"# megatron-rl train {recipe or 'grpo'}{''.join(' ' + o for o in overrides)}: the resolved config "
        "(every key: docs/reference/configuration.md)"
    )
    print(dump_config(config), end="")
    return 0


EXIT_CODES = {
    0: "success",
    1: "a failure during the run (named; the last good checkpoint is intact)",
    2: "bad input (nothing trained, nothing changed)",
    130: "SIGINT (Ctrl-C)",
    143: "SIGTERM (preemption)",
}
"""``megatron-rl train``'s exit codes (README: "When things go wrong")."""


def _run_and_exit_code(run_train, *args, **kwargs) -> int:
    """``run_train(...)`` -> an exit code of ``EXIT_CODES``, with one line naming what went wrong (no traceback,
    except for an error of an unexpected kind: a bug)."""
    from megatron_rl.trainer.watchdog import Stopped

    try:
        run_train(*args, **kwargs)
    except (ValueError, FileNotFoundError) as err:  # bad input: nothing was trained
        print(f"megatron-rl train: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the run failed (a worker died, rewards kept failing, a full disk, a hang ...)
        print(f"megatron-rl train: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:  # SIGTERM / SIGINT: the run shut down cleanly
        print(f"megatron-rl train: {stop}", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print("megatron-rl train: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - an unexpected kind of error: a bug, keep its traceback
        import traceback

        traceback.print_exc()
        print(f"megatron-rl train: unexpected {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


def _finite_number(what: str, low: float = 0.0, *, inclusive: bool = False):
    """An argparse ``type``: a finite number above ``low`` (at least ``low`` with ``inclusive``); the error
    names the text and ``what`` it counts."""
    import math

    bound = f"{'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or (value < low if inclusive else value <= low):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of {what} {bound}")
        return value

    return parse


_gpu_memory_gb = _finite_number("GiB")  # --gpu-memory-gb
_tokens = _finite_number("tokens")  # --response-length-*
_rounds = _finite_number("rounds", 1, inclusive=True)  # --generation-rounds


def _cmd_plan(args: argparse.Namespace) -> int:
    from megatron_rl.job.layout_hint import with_layout_hint
    from megatron_rl.job.main_job import load_run_config
    from megatron_rl.planner import format_plan, plan_json, plan_run
    from megatron_rl.planner.hardware import get_hardware
    from megatron_rl.planner.step_time import estimate_step_time, format_step_time, step_time_json

    overrides = list(args.overrides)
    if args.config_path is not None or args.config_name is not None:  # verl's command line, as main_ppo reads it
        if args.recipe is not None:  # argparse took the first override for the recipe
            overrides.insert(0, args.recipe)
    elif args.recipe is None:
        print(
            "megatron-rl plan: give a recipe (a name under recipes/ or a YAML path) or verl's "
            "--config-path/--config-name",
            file=sys.stderr,
        )
        return 2
    if args.nodes is not None:
        overrides.append(f"trainer.nnodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"trainer.n_gpus_per_node={args.gpus_per_node}")
    try:
        hardware = get_hardware(args.hardware)
        recipe = args.recipe
        if args.config_path is not None or args.config_name is not None:
            from megatron_rl.config.loader import drop_engine_choice, find_verl_config

            overrides = drop_engine_choice(overrides)
            recipe = str(find_verl_config(args.config_name or "ppo_trainer", args.config_path))
        config, raw = load_run_config(recipe, overrides)
        gpu_memory_gb = args.gpu_memory_gb or hardware.memory_gib
        with with_layout_hint(raw):  # an invalid layout gets the nearest valid one, as a misfit one does
            plan = plan_run(config, gpu_memory_gb=gpu_memory_gb, architecture=args.architecture)
        step = (
            None
            if plan.device != "cuda"
            else estimate_step_time(
                config,
                plan,
                hardware=hardware.name,
                response_length_mean=args.response_length_mean,
                response_length_p99=args.response_length_p99,
                generation_rounds=args.generation_rounds,
            )
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"megatron-rl plan: {err}", file=sys.stderr)
        return 2
    if args.json:  # one JSON object (its "rollout" member is the engine map; step time: null on CPU)
        import json

        out = plan_json(plan)
        out.update(step_time_json(step) if step else {"step_time_s": None, "tokens_per_s_per_gpu": None, "phases": {}})
        print(json.dumps(out))
    else:
        print(format_plan(plan))
        if step:
            print(format_step_time(step))
    return 0 if plan.fits else 1


def _train_epilog() -> str:
    """``train --help``'s list of the built-in recipes and the exit codes."""
    import textwrap

    from megatron_rl.config.loader import list_recipes

    recipes = textwrap.fill(", ".join(list_recipes()), width=96, initial_indent="  ", subsequent_indent="  ")
    codes = "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES.items())
    return f"built-in recipes:\n{recipes}\n\nexit codes:\n{codes}"


# megatron_rl.planner.architectures.KNOWN_ARCHITECTURES by name (importing it here would slow every command's
# start-up); tests/megatron_rl/test_planner.py checks the two agree.
PLANNER_ARCHITECTURES = (
    "deepseek_r1",
    "deepseek_v3",
    "glm4_5",
    "glm4_5_air",
    "llama3_1_70b",
    "qwen3_235b_a22b",
    "qwen3_30b_a3b",
    "qwen3_32b",
)


# megatron_rl.planner.hardware.HARDWARE by name (tests/megatron_rl/planner/test_step_time.py checks they agree).
PLANNER_HARDWARE = ("H100", "H200", "H800", "A100", "B200", "GB200")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="RL post-training (PPO, GRPO, DAPO, GSPO, ...) with Megatron-Core, vLLM and Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=_cmd_version)
    p = sub.add_parser("bench", help="run a benchmark from tools/ and print its JSON summary")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser(
        "convert",
        help="convert checkpoints: HF -> Megatron dist checkpoint, or back",
        description="Run megatron_rl.convert.hf_to_mcore (hf-to-mcore) or "
        "megatron_rl.convert.mcore_to_hf (mcore-to-hf); the remaining arguments go to the tool "
        "(see its --help).",
    )
    p.add_argument("direction", choices=sorted(CONVERTERS), help="which conversion")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the converter")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser(
        "train",
        help="run an RL recipe (default: GRPO on the CPU toy task)",
        description="Train with a recipe (a name under recipes/ or a YAML path; default: grpo, "
        "the CPU toy run) and Hydra-style key=value overrides. Writes metrics.jsonl, "
        "reward_curve.png and an HF checkpoint to trainer.default_local_dir (the CPU "
        "recipes: outputs/<experiment_name>; verl's default: "
        "checkpoints/<project>/<experiment>). Every config key (type, default, "
        "verl's key, what it does or why it is inert) is in the configuration reference "
        "of the docs, docs/reference/configuration.md (generated from megatron_rl.config "
        "by tools/gen_config_reference.py; `mkdocs serve` shows it); --show-config "
        "prints a recipe's resolved values.",
        epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", nargs="?", default=None, help="recipe name or YAML path (default: grpo)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_training_steps=5")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one console line per step)")
    p.add_argument(
        "--show-config",
        action="store_true",
        help="print the resolved config (recipe + overrides + derived keys) as YAML and exit; runs nothing",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="a config file, e.g. a verl 0.9.1 one (Hydra overrides follow: key=value, +key=value, ~key); "
        "prints which keys act, have no effect here, or are refused",
    )
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser(
        "plan",
        help="dry run: validate a recipe's layout on a cluster and estimate memory per GPU",
        description="Validate TP/PP/VPP/EP/ETP/CP/DP and batch sizes against the model and the "
        "cluster, show the rank placement and the per-GPU memory per phase; exit 1 "
        "with the nearest fitting layout when the peak exceeds the GPU memory, 2 when "
        "the layout is invalid. Needs no GPU.",
    )
    p.add_argument(
        "recipe", nargs="?", default=None, help="recipe name or YAML path (or none, with --config-path/--config-name)"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides (Hydra's +key=value, ~key with verl's config)")
    p.add_argument(
        "--config-path",
        "-cp",
        default=None,
        metavar="DIR",
        help="verl's Hydra config directory, as megatron_rl.main_ppo takes it",
    )
    p.add_argument(
        "--config-name",
        "-cn",
        default=None,
        metavar="NAME",
        help="verl's config name (DIR/NAME.yaml, else verl's ppo_megatron_trainer; default ppo_trainer)",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's trainer.nnodes)")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (default: the recipe's trainer.n_gpus_per_node)"
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=_gpu_memory_gb,
        default=None,
        help="memory per GPU in GiB (default: the --hardware GPU's, 80 for H100)",
    )
    p.add_argument(
        "--hardware",
        default="H100",
        metavar="NAME",
        help=f"GPU of the step-time estimate, one of {', '.join(PLANNER_HARDWARE)} (default H100)",
    )
    p.add_argument(
        "--response-length-mean",
        type=_tokens,
        default=None,
        metavar="TOKENS",
        help="mean generated tokens per response (default: data.max_response_length)",
    )
    p.add_argument(
        "--response-length-p99",
        type=_tokens,
        default=None,
        metavar="TOKENS",
        help="99th-percentile response length: the step waits for its longest (default: the maximum)",
    )
    p.add_argument(
        "--generation-rounds",
        type=_rounds,
        default=1.0,
        metavar="N",
        help="generation rounds per step: DAPO's dynamic sampling regenerates until enough groups are informative "
        "(a run's filter_groups/num_gen_batches; default 1)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print the plan as one JSON object (its "rollout" member: the vLLM engines\' GPUs per node)',
    )
    p.add_argument(
        "--architecture",
        default=None,
        help="built-in architecture when the checkpoint is not local (one of "
        f"{', '.join(PLANNER_ARCHITECTURES)}); default: inferred from the checkpoint path",
    )
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `plan|train RECIPE --option key=value`: overrides may follow the options
        if getattr(args, "command", None) not in ("plan", "train") or any(
            e.startswith("-") or "=" not in e for e in extra
        ):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""verl's launcher, by verl's name: ``python -m megatron_rl.main_ppo --config-path DIR --config-name NAME k=v ...``.

A verl user's shell script runs with only the module name changed (``verl.trainer.main_ppo`` ->
``megatron_rl.main_ppo``): Hydra's ``--config-path`` / ``--config-name`` (``=`` or a space,
``-cp`` / ``-cn`` too) pick the YAML file -- ``DIR/NAME.yaml`` when it exists, else verl's own
``ppo_megatron_trainer`` (also for ``ppo_trainer``, verl's default name) kept in
``megatron_rl/config/verl`` -- and the remaining arguments are Hydra overrides (``key=value``,
``+key=value``, ``++key=value``, ``~key``, ``key=null``; ``model_engine=megatron`` is accepted as
verl's engine choice). Before anything starts it prints the key table: keys acted on, keys
accepted with no effect here (those set away from verl's default are warned by name), keys
refused with the nearest valid key. A refused key, a bad value or an impossible layout exits 2;
a failed run exits 1. The run itself is ``megatron-rl train``'s (``megatron_rl.job.main_job.run_train``).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main", "parse_args"]

_DEFAULT_NAME = "ppo_trainer"  # verl's @hydra.main default; only the Megatron engine exists here


def parse_args(argv: Sequence[str]) -> tuple[Optional[str], str, list[str]]:
    """``(config_path or None, config_name, overrides)`` from Hydra's command line."""
    config_path, config_name, overrides = None, _DEFAULT_NAME, []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        for flags, slot in ((("--config-path", "-cp"), "path"), (("--config-name", "-cn"), "name")):
            flag = next((f for f in flags if arg == f or arg.startswith(f + "=")), None)
            if flag is None:
                continue
            if arg == flag:
                if i + 1 >= len(args):
                    raise ValueError(f"{flag} needs a value")
                value, i = args[i + 1], i + 1
            else:
                value = arg[len(flag) + 1 :]
            if slot == "path":
                config_path = value
            else:
                config_name = value
            break
        else:
            if arg.startswith("-") and not arg.startswith("--config"):
                raise ValueError(
                    f"unknown option {arg!r}: main_ppo takes --config-path, --config-name and "
                    "Hydra overrides (key=value, +key=value, ~key)"
                )
            overrides.append(arg)
        i += 1
    return config_path, config_name, overrides


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run verl's command line; the exit status (0 done, 1 the run failed, 2 bad input)."""
    from megatron_rl.config.loader import drop_engine_choice, find_verl_config, key_report

    try:
        config_path, config_name, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        overrides = drop_engine_choice(overrides)
        config_file = str(find_verl_config(config_name, config_path))
        report, refused = key_report(config_file, overrides)
    except ValueError as err:
        print(f"main_ppo: {err}", file=sys.stderr)
        return 2
    print(report, flush=True)
    if refused:
        print("main_ppo: refused keys (see above); nothing was started", file=sys.stderr)
        return 2
    from megatron_rl.job.main_job import run_train

    try:
        run_train(config_file, overrides)
    except (ValueError, FileNotFoundError) as err:  # bad input: nothing was trained
        print(f"main_ppo: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the run failed
        print(f"main_ppo: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MkDocs hooks (``mkdocs.yml``: ``hooks:``): the generated parts of the docs, made at build time from the code.

- ``reference/configuration.md``: ``tools/gen_config_reference.py`` (every accepted key);
- ``img/step_phases_grpo.svg``, ``img/step_phases_ppo.svg``, ``img/layers.svg``: ``tools/gen_pictures.py``
  (the trainer's ``StepSchedule``; ``.importlinter``);
- in a page, ``<!-- generated: algorithms -->`` becomes ``tools/gen_algorithm_reference.py``'s sections, and
  ``<!-- generated: megatron-rl ARGS -->`` becomes a code block with what ``megatron-rl ARGS`` prints now
  (CPU-only commands: the build runs them, so a documented command that stops working fails the build);
  ``<!-- generated: verl key table -->`` is the key table of verl's own generated config, and
  ``<!-- generated: include PATH -->`` the Markdown file PATH of the repository (``recipes/slurm/README.md``).

Nothing generated is committed; ``mkdocs build --strict`` (``tests/test_docs.py``) runs all of it.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_GENERATED = re.compile(r"<!-- generated: (.+?) -->")
PICTURES = {"img/step_phases_grpo.svg": "gpu/qwen3_30b_a3b_grpo", "img/step_phases_ppo.svg": "gpu/qwen3_30b_a3b_ppo"}
"""Generated step-phase pictures -> the recipe whose ``StepSchedule`` each draws (on GPU: the rollout sleeps)."""


def on_files(files, config):
    """Add the generated pages and pictures to the site."""
    from mkdocs.structure.files import File

    from tools import gen_config_reference, gen_pictures

    generated = {"reference/configuration.md": gen_config_reference.render(), "img/layers.svg": gen_pictures.layers()}
    generated.update({path: gen_pictures.step_phases(recipe) for path, recipe in PICTURES.items()})
    for path, content in generated.items():
        files.append(File.generated(config, path, content=content))
    return files


def run_command(args: str) -> str:
    """What ``megatron-rl ARGS`` prints (stdout and stderr), and its exit code when not 0."""
    from megatron_rl.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = main(shlex.split(args))
        except SystemExit as done:  # argparse's --help and usage errors
            code = done.code or 0
    return out.getvalue().rstrip() + ("" if code == 0 else f"\n(exit code {code})")


def _expand(match: re.Match) -> str:
    what = match.group(1).strip()
    if what == "algorithms":
        from tools import gen_algorithm_reference

        return gen_algorithm_reference.render()
    if what == "verl key table":  # what `megatron-rl train --config <verl's own config>` prints before it starts
        from megatron_rl.config.loader import key_report
        from megatron_rl.config.verl_keys import VERL_CONFIG_DIR

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report, _ = key_report(VERL_CONFIG_DIR / "ppo_megatron_trainer.yaml")
        return f"```text\n{report.replace(str(ROOT) + '/', '')}\n```"
    if what.startswith("include "):  # a Markdown file of the repository outside docs/, its headings one level down
        text = (ROOT / what[len("include ") :]).read_text()
        return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)
    if what.startswith("megatron-rl "):
        return f"```console\n$ {what}\n{run_command(what[len('megatron-rl ') :])}\n```"
    raise ValueError(f"unknown generated block {what!r}")


def on_page_markdown(markdown, page, config, files):
    """Expand the page's ``<!-- generated: ... -->`` markers."""
    return _GENERATED.sub(_expand, markdown)

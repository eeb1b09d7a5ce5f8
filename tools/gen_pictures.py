"""The documentation's pictures, drawn as SVG from the code (never by hand).

- ``step_phases(recipe)``: the phases of one colocated training step and what each role keeps on its
  device in each (``megatron_rl.trainer.schedule.step_schedule``, the schedule the trainer runs and the
  planner sums);
- ``layers()``: the layers of the package and its forbidden imports (``.importlinter``, which
  ``lint-imports`` enforces);
- ``reward_curve(metrics.jsonl)``: the mean training reward, the exact-answer fraction (its own axis) and
  the validation reward of a run.

The docs build (``tools/gen_docs_hooks.py``) calls the first two; ``python tools/gen_pictures.py
reward-curve RUN/metrics.jsonl OUT.svg [TITLE]`` draws the third from a run (TITLE: the picture's
title, by default "reward curve of" the run directory's name).

    python tools/gen_pictures.py step-phases gpu/qwen3_30b_a3b_ppo OUT.svg
    python tools/gen_pictures.py layers OUT.svg
    python tools/gen_pictures.py reward-curve outputs/toy_grpo/metrics.jsonl OUT.svg
    python tools/gen_pictures.py reward-curve outputs/toy_rloo/metrics.jsonl OUT.svg "rloo: reward per step"
"""

from __future__ import annotations

import configparser
import json
import math
import sys
import warnings
from html import escape
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["step_phases", "layers", "reward_curve"]

_FONT = 'font-family="Helvetica, Arial, sans-serif"'
_PART_LABEL = {"params": "P", "grads": "G", "optimizer": "O", "weights": "W", "kv_cache": "KV"}
_PART_COLOR = {
    "params": "#4e79a7",
    "grads": "#f28e2b",
    "optimizer": "#e15759",
    "weights": "#59a14f",
    "kv_cache": "#76b7b2",
}


def _svg(width: int, height: int, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {_FONT} font-size="12">\n'
        f'<rect width="{width}" height="{height}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def _text(x: float, y: float, text: str, **attrs: str) -> str:
    extra = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" {extra}>{escape(text)}</text>'


def step_phases(recipe: str = "gpu/qwen3_30b_a3b_ppo", device: str = "cuda") -> str:
    """The ``StepSchedule`` of ``recipe`` as a grid: a column per phase, a row per role (and the rollout),
    each cell the parts resident on the device (P params, G grads, O optimizer, W weights, KV cache)."""
    from megatron_rl.algos.needs import resolve_run
    from megatron_rl.config.loader import compose
    from megatron_rl.config.run_config import RunConfig
    from megatron_rl.trainer.schedule import step_schedule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = RunConfig.from_dict(compose(recipe))
        schedule = step_schedule(config, resolve_run(config), device=device)
    rows = [*schedule.roles, "rollout"]
    col_w, row_h, left, top = 112, 34, 90, 56
    width, height = left + col_w * len(schedule.phases) + 20, top + row_h * len(rows) + 64
    body = [_text(10, 20, f"One step of {recipe} ({device}): what each role keeps on its device", font_weight="bold")]
    for j, phase in enumerate(schedule.phases):
        x = left + j * col_w
        body.append(_text(x + col_w / 2, top - 10, phase.label or phase.name, text_anchor="middle"))
        if j:
            body.append(f'<path d="M{x - 4} {top - 14} l6 -4 l-6 -4" fill="none" stroke="#999"/>')
    for i, role in enumerate(rows):
        y = top + i * row_h
        body.append(_text(10, y + row_h / 2 + 4, role, font_weight="bold"))
        for j, phase in enumerate(schedule.phases):
            x = left + j * col_w
            parts = schedule.resident(phase.name)[role]
            active = phase.active == role or (role == "rollout" and phase.active is None)
            body.append(
                f'<rect x="{x + 2}" y="{y + 2}" width="{col_w - 4}" height="{row_h - 4}" rx="4" '
                f'fill="{"#fff7d6" if active else "#f4f4f4"}" stroke="{"#c9a400" if active else "#ddd"}"/>'
            )
            for k, part in enumerate(parts):
                bx = x + 8 + k * 30
                body.append(
                    f'<rect x="{bx}" y="{y + 8}" width="26" height="{row_h - 16}" rx="3" fill="{_PART_COLOR[part]}"/>'
                )
                body.append(
                    _text(
                        bx + 13,
                        y + row_h / 2 + 4,
                        _PART_LABEL[part],
                        text_anchor="middle",
                        fill="white",
                        font_size="11",
                    )
                )
            if not parts:
                body.append(
                    _text(
                        x + col_w / 2,
                        y + row_h / 2 + 4,
                        "host / asleep" if role != "rollout" or schedule.rollout_sleeps else "-",
                        text_anchor="middle",
                        fill="#999",
                        font_size="10",
                    )
                )
    y = top + len(rows) * row_h + 22
    legend = [
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer", "optimizer state"),
        ("weights", "vLLM weights"),
        ("kv_cache", "vLLM KV cache"),
    ]
    for k, (part, name) in enumerate(legend):
        x = 10 + k * 140
        body.append(f'<rect x="{x}" y="{y - 11}" width="22" height="15" rx="3" fill="{_PART_COLOR[part]}"/>')
        body.append(_text(x + 11, y, _PART_LABEL[part], text_anchor="middle", fill="white", font_size="10"))
        body.append(_text(x + 28, y, name))
    body.append(
        _text(
            10,
            y + 22,
            "highlighted: the role computing in that phase; offload keys: "
            + ", ".join(f"{r}={'+'.join(p) or 'none'}" for r, p in schedule.offload.items()),
            fill="#555",
            font_size="11",
        )
    )
    return _svg(width, height, body)


def _importlinter() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    return parser


def layers() -> str:
    """The ``layers`` contract of ``.importlinter`` as a stack (imports go down only), with ``parallel``
    beside it and the forbidden contracts listed."""
    parser = _importlinter()
    layer_lines = [
        line.strip() for line in parser["importlinter:contract:layers"]["layers"].splitlines() if line.strip()
    ]
    forbidden = [
        parser[s]["name"]
        for s in parser.sections()
        if s.startswith("importlinter:contract:") and parser[s].get("type") == "forbidden"
    ]
    box_w, box_h, gap, left, top = 420, 30, 10, 20, 44
    height = top + len(layer_lines) * (box_h + gap) + 40 + 18 * len(forbidden)
    width = left + box_w + 260
    body = [_text(left, 22, "Layers of megatron_rl (.importlinter): an import may only go down", font_weight="bold")]
    for i, line in enumerate(layer_lines):
        y = top + i * (box_h + gap)
        body.append(
            f'<rect x="{left}" y="{y}" width="{box_w}" height="{box_h}" rx="5" fill="#eef3fb" stroke="#4e79a7"/>'
        )
        names = "   |   ".join(part.strip().replace("megatron_rl.", "") for part in line.split("|"))
        body.append(_text(left + box_w / 2, y + box_h / 2 + 4, names, text_anchor="middle"))
        if i:
            body.append(
                f'<path d="M{left + box_w / 2} {y - gap} v{gap - 1}" stroke="#4e79a7" marker-end="url(#arrow)"/>'
            )
    stack_h = len(layer_lines) * (box_h + gap) - gap
    px = left + box_w + 40
    body.append(f'<rect x="{px}" y="{top}" width="200" height="{stack_h}" rx="5" fill="#f1f8ee" stroke="#59a14f"/>')
    body.append(_text(px + 100, top + stack_h / 2 - 8, "parallel", text_anchor="middle", font_weight="bold"))
    body.append(
        _text(px + 100, top + stack_h / 2 + 10, "ranks and shards, no RL;", text_anchor="middle", font_size="11")
    )
    body.append(_text(px + 100, top + stack_h / 2 + 26, "imports no megatron_rl", text_anchor="middle", font_size="11"))
    body.insert(
        0,
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="4" refY="7" orient="auto">'
        '<path d="M0 0 L4 8 L8 0" fill="#4e79a7" transform="rotate(0)"/></marker></defs>',
    )
    y = top + stack_h + 30
    body.append(_text(left, y, "Forbidden imports (also enforced):", font_weight="bold"))
    for k, name in enumerate(forbidden):
        body.append(_text(left + 10, y + 18 * (k + 1), "- " + name, font_size="11"))
    return _svg(width, height, body)


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def reward_curve(metrics: Path, title: str = "") -> str:
    """Mean training reward per step (left axis), exact-answer fraction (its own right axis, in %) and
    the validation reward at the steps it was measured, from a run's ``metrics.jsonl``."""
    from megatron_rl.job.report import REWARD_KEY, as_number, validation_reward

    rows = _rows(Path(metrics))
    train = [
        (int(r["training/global_step"]), float(r[REWARD_KEY]))
        for r in rows
        if as_number(r.get(REWARD_KEY)) is not None and "training/global_step" in r
    ]
    exact = [
        (int(r["training/global_step"]), float(r["reward/acc/mean"]))
        for r in rows
        if as_number(r.get("reward/acc/mean")) is not None and "training/global_step" in r
    ]
    val = [
        (int(r.get("step", r.get("training/global_step", 0))), v)
        for r in rows
        if (v := validation_reward(r)) is not None
    ]
    if not train:
        raise ValueError(f"{metrics}: no step with {REWARD_KEY}")
    width, height, left, right, top, bottom = 640, 320, 56, 56, 34, 44
    last = max(s for s, _ in train + val) or 1
    exact_top = max(0.1, math.ceil(max((v for _, v in exact), default=0.1) * 10) / 10)

    def px(step: float) -> float:
        return left + (width - left - right) * step / last

    def py(value: float, top_value: float = 1.0) -> float:
        return top + (height - top - bottom) * (1 - value / top_value)

    body = [_text(left, 20, title or f"reward curve of {Path(metrics).parent.name}", font_weight="bold")]
    for k in range(6):
        v = k / 5
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#eee"/>')
        body.append(_text(left - 6, py(v) + 4, f"{v:.1f}", text_anchor="end", font_size="10"))
        if exact:
            body.append(_text(width - right + 6, py(v) + 4, f"{v * exact_top:.0%}", font_size="10", fill="#e15759"))
    for k in range(6):
        s = last * k / 5
        body.append(_text(px(s), height - bottom + 16, f"{s:.0f}", text_anchor="middle", font_size="10"))
    body.append(_text((left + width - right) / 2, height - 8, "step", text_anchor="middle"))
    body.append(
        _text(
            14,
            (top + height - bottom) / 2,
            "reward",
            text_anchor="middle",
            transform=f"rotate(-90 14 {(top + height - bottom) / 2})",
        )
    )
    if exact:
        x = width - 12
        body.append(
            _text(
                x,
                (top + height - bottom) / 2,
                "exact answers",
                text_anchor="middle",
                fill="#e15759",
                transform=f"rotate(90 {x} {(top + height - bottom) / 2})",
            )
        )

    def line(
        points: Sequence[tuple[int, float]], color: str, top_value: float = 1.0, w: float = 1.5, opacity: float = 1.0
    ) -> str:
        d = " ".join(f"{'M' if i == 0 else 'L'}{px(s):.1f} {py(v, top_value):.1f}" for i, (s, v) in enumerate(points))
        return f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{w}" opacity="{opacity}"/>'

    window = 10
    values = [v for _, v in train]
    smooth = [
        (s, sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]))
        for i, (s, _) in enumerate(train)
    ]
    body.append(line(train, "#4e79a7", w=1, opacity=0.35))
    body.append(line(smooth, "#4e79a7", w=2))
    if exact:
        body.append(line(exact, "#e15759", exact_top, w=1.2, opacity=0.8))
    if val:
        body.append(line(val, "#59a14f", w=1.5))
        body += [f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="3" fill="#59a14f"/>' for s, v in val]
    legend = [("#4e79a7", f"mean training reward ({window}-step avg)")]
    legend += [("#e15759", "exact answers (right axis)")] if exact else []
    legend += [("#59a14f", "validation reward (greedy)")] if val else []
    for k, (color, name) in enumerate(legend):
        y = top + 10 + 16 * k
        body.append(
            f'<line x1="{left + 10}" x2="{left + 30}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" stroke-width="2"/>'
        )
        body.append(_text(left + 36, y, name, font_size="11"))
    return _svg(width, height, body)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "step-phases":
        Path(argv[2]).write_text(step_phases(argv[1]))
    elif len(argv) == 2 and argv[0] == "layers":
        Path(argv[1]).write_text(layers())
    elif len(argv) in (3, 4) and argv[0] == "reward-curve":
        Path(argv[2]).write_text(reward_curve(Path(argv[1]), *argv[3:]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

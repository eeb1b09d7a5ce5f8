"""Write the configuration reference (docs/reference/configuration.md) from the typed config.

Every key ``megatron-rl train`` accepts is one row: the leaves of ``RunConfig`` (type, default,
verl's key, the field's docstring -- or, for a key in ``megatron_rl.config.compat.INERT_KEYS``, why it
has no effect) and then verl 0.9.1's keys that the typed tree has no field for but accepts with no
effect (grouped by their reason), and verl's deprecated micro-batch keys that act through a per-GPU field.
Nothing here is written by hand: the docs build (``docs/hooks.py``)
calls ``render()``, so the page cannot disagree with the code; ``tests/test_docs.py`` checks the page
against the schema's leaves, verl's catalogue and the inert list independently.

    python tools/gen_config_reference.py [OUT.md]     # default: print to stdout
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["Row", "field_docs", "schema_rows", "verl_only_rows", "translated_rows", "render"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One accepted key of the reference."""

    key: str
    type: str
    default: str
    verl_key: str
    """verl's key this one equals (the same dotted path), or '' when verl has none."""
    doc: str
    inert: Optional[str]
    """Why the key has no effect (``INERT_KEYS``), or None when it acts."""


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (the string right under the field), over ``cls``'s MRO."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:] + [None]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    for prefix in ("typing.", "collections.abc.", "megatron_rl.config.", "parallel.config."):
        text = text.replace(prefix, "")
    return text.replace("NoneType", "None")


def _default(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = value.to_dict() if hasattr(value, "to_dict") else dataclasses.asdict(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _walk(cls: type, instance: Any, prefix: str) -> Iterator[tuple[str, Any, Any, str, Optional[type]]]:
    """``(path, hint, default, doc, section class or None)`` of every field under ``cls``, depth first."""
    from megatron_rl.config.base_config import is_internal
    from megatron_rl.config.schema import config_class

    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if is_internal(f):
            continue
        path, hint = prefix + f.name, hints[f.name]
        default = getattr(instance, f.name) if instance is not None else _field_default(f)
        sub = config_class(hint)
        yield path, hint, default, docs.get(f.name, ""), sub
        if sub is not None:
            yield from _walk(sub, default if isinstance(default, sub) else _try_default(sub), path + ".")


def _try_default(cls: type) -> Any:
    try:
        return cls()
    except Exception:  # a section whose defaults do not validate alone (e.g. needs a model): read field defaults
        return None


def schema_rows() -> list[tuple[str, str, list[Row]]]:
    """``(section path, section doc, rows)`` for every section of ``RunConfig`` that has leaves."""
    from megatron_rl.config.compat import inert_reason
    from megatron_rl.config.run_config import DERIVED_KEYS, RunConfig
    from megatron_rl.config.verl_keys import is_verl_key

    derived = dict(DERIVED_KEYS)
    sections: dict[str, tuple[str, list[Row]]] = {"": ("The top level of a run.", [])}
    for path, hint, default, doc, sub in _walk(RunConfig, None, ""):
        parent = path.rpartition(".")[0]
        if sub is not None:
            first = (inspect.getdoc(sub) or "").split("\n\n")[0]
            sections.setdefault(path, (" ".join(first.split()) or doc, []))
            if default is not None:
                continue  # a section, not a leaf (an Optional section left None is a leaf too: set it or not)
        shown = f"= `{derived[path]}`" if path in derived else f"`{_default(default)}`"
        sections.setdefault(parent, ("", []))[1].append(
            Row(path, _type_name(hint), shown, path if is_verl_key(path) else "", doc, inert_reason(path))
        )
    return [(path, doc, rows) for path, (doc, rows) in sections.items() if rows]


def verl_only_rows() -> dict[str, list[tuple[str, str]]]:
    """verl keys accepted with no effect and no field here: ``INERT_KEYS`` reason -> ``[(key, verl default)]``."""
    from megatron_rl.config.compat import inert_reason
    from megatron_rl.config.schema import all_paths
    from megatron_rl.config.run_config import RunConfig
    from megatron_rl.config.verl_keys import NO_DEFAULT, verl_catalogue

    known = set(all_paths(RunConfig))
    out: dict[str, list[tuple[str, str]]] = {}
    for path, default in sorted(verl_catalogue().items()):
        if path in known or any(path.startswith(k + ".") for k in known if _free_form(k)):
            continue
        reason = inert_reason(path)
        if reason is not None:
            out.setdefault(reason, []).append((path, "(derived)" if default is NO_DEFAULT else _default(default)))
    return out


def translated_rows() -> list[tuple[str, str, str]]:
    """verl's deprecated global micro-batch keys, which act by setting a per-GPU field:
    ``[(key, verl default, the field it sets)]``."""
    from megatron_rl.config.schema import all_paths
    from megatron_rl.config.run_config import RunConfig
    from megatron_rl.config.verl_keys import TRANSLATED, verl_catalogue

    known = set(all_paths(RunConfig))
    out = []
    for path, default in sorted(verl_catalogue().items()):
        parent, _, leaf = path.rpartition(".")
        if leaf in TRANSLATED and path not in known and f"{parent}.{TRANSLATED[leaf]}" in known:
            out.append((path, _default(default), f"{parent}.{TRANSLATED[leaf]}"))
    return out


def _free_form(path: str) -> bool:
    """A schema field whose value is an open mapping (keys under it are its own)."""
    from megatron_rl.config.schema import field_hint
    from megatron_rl.config.run_config import RunConfig

    cls: Any = RunConfig
    parts = path.split(".")
    for part in parts[:-1]:
        hint = field_hint(cls, part)
        if hint is None or hint[1] is None:
            return False
        cls = hint[1]
    hint = field_hint(cls, parts[-1])
    if hint is None or hint[1] is not None:
        return False
    args = typing.get_args(hint[0]) or (hint[0],)
    return hint[0] is Any or any(a is dict or typing.get_origin(a) in (dict, Mapping) for a in args)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole page (Markdown)."""
    sections = schema_rows()
    inert_only = verl_only_rows()
    num_keys = sum(len(rows) for _, _, rows in sections)
    num_inert = sum(1 for _, _, rows in sections for r in rows if r.inert)
    num_verl_only = sum(len(keys) for keys in inert_only.values())
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by tools/gen_config_reference.py from megatron_rl.config at docs build time: do not edit. -->",
        "",
        f"Every key `megatron-rl train` accepts: the {num_keys} fields of the typed config "
        f"(`megatron_rl.config.RunConfig`; {num_keys - num_inert} act, {num_inert} are accepted with no "
        f"effect) and {num_verl_only} further keys of verl 0.9.1's generated config that are accepted with no "
        "effect. Any other key is refused with the nearest valid one. Set a key in a recipe's YAML or on the "
        "command line (`megatron-rl train grpo trainer.total_training_steps=20`); "
        "`megatron-rl train RECIPE --show-config` prints a recipe's resolved values.",
        "",
        "*verl key* is verl's key of the same name and meaning where verl has one. A key marked **inert** "
        "is accepted so that a verl config loads unchanged; set away from its default it warns by name, "
        "with the reason given here (`megatron_rl/config/compat.py`). A default `= key` is copied from that "
        "key when left out, as verl's interpolations do.",
        "",
    ]
    for path, doc, rows in sections:
        lines += [
            f"## `{path or 'top level'}`",
            "",
            doc,
            "",
            "| key | type | default | verl key | what it does |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            what = f"**inert**: {r.inert}" if r.inert else (r.doc or "")
            lines.append(
                f"| `{r.key}` | `{_cell(r.type)}` | {_cell(r.default)} | {'same' if r.verl_key else '—'} "
                f"| {_cell(what)} |"
            )
        lines.append("")
    lines += [
        "## verl's deprecated micro-batch keys",
        "",
        "verl's global micro-batch sizes act: each sets the per-GPU key beside it to `value // data-parallel "
        "size`, as verl's workers do.",
        "",
        "| verl key | verl's default | sets |",
        "|---|---|---|",
    ]
    lines += [f"| `{key}` | `{_cell(default)}` | `{target}` |" for key, default, target in translated_rows()]
    lines.append("")
    lines += [
        "## verl keys without a field here (inert)",
        "",
        "These keys of verl's config have no field in the typed tree; they are accepted (and read back as "
        "given on their section) but do nothing. Grouped by the reason.",
        "",
    ]
    for reason, keys in inert_only.items():
        lines += [f"**{_cell(reason)}**", "", "| verl key | verl's default |", "|---|---|"]
        lines += [f"| `{key}` | `{_cell(default)}` |" for key, default in keys]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

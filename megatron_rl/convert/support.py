"""What tools/convert_hf_to_mcore.py and tools/convert_mcore_to_hf.py share: constants, errors, files.

* ``ToolError`` is a user-facing failure: printed as ``error: <message>``, exit code 1 (``run_main``).
  A full disk is named as one (``ensure_space`` before the writing starts; ``run_main`` for a
  write that fails with ENOSPC anyway): the output path, the bytes needed and free.
* side files (tokenizer, generation config, config.json), the tokenizer-vs-vocabulary check,
  the metadata file of a converted Megatron checkpoint.

The rest lives beside it: ``megatron_rl.convert.launch`` (ranks: spawned, forked from a preloaded server,
or torchrun; the layout flags), ``megatron_rl.convert.output`` (the atomic output directory, progress,
peak memory), ``megatron_rl.convert.verify`` (``--verify``'s logits and tolerances),
``megatron_rl.convert.streamed_model`` (meta-device models filled tensor by tensor), ``megatron_rl.convert.fault``
(the test-only wrong mappings) and ``megatron_rl.convert.megatron_lm`` (Megatron-LM's ``--load`` layout).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

# No torch (nor transformers) at import: the drivers start the ranks' fork server before anything
# heavy is loaded (``megatron_rl.convert.launch.prestart``).

METADATA_FILE = "megatron_rl_conversion.json"
"""Written next to the Megatron checkpoint: family, HF config, layout, dtype."""
METADATA_VERSION = 1
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files copied next to the weights in both directions (those that exist)."""
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def skip_init(tensor: torch.Tensor) -> None:
    """An ``init_method`` that draws nothing (the converters overwrite every value)."""


NO_INIT = {"init_method": skip_init, "output_layer_init_method": skip_init}
"""``build_transformer_config`` overrides for a model whose weights are all loaded: Megatron still
sets its TP attributes (``perform_initialization=False`` would drop them) but draws no random numbers."""
_EXPECTED_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


class ToolError(Exception):
    """A failure to report as one message (no traceback), exit code 1."""


def ensure_space(out_dir: str | os.PathLike, needed: int, what: str) -> None:
    """``ToolError`` (a full disk: path, bytes needed and free) unless ``needed`` bytes fit where ``out_dir`` goes."""
    from parallel.checkpoint import DiskFullError, check_free_space

    try:
        check_free_space(out_dir, needed, what)
    except DiskFullError as exc:
        raise ToolError(str(exc)) from None


def _disk_full_message(exc: BaseException, output: Optional[str]) -> Optional[str]:
    """The full-disk message for ``exc`` when it is one (ENOSPC in any rank, or torch's ``unexpected
    pos`` with the output's file system nearly full), else None."""
    from parallel.checkpoint import free_bytes, fmt_bytes as fmt, is_disk_full

    if output is None or str(exc).startswith("disk full:"):
        return None
    free = free_bytes(output)
    if is_disk_full(exc) or ("unexpected pos" in str(exc) and free < 64 * 2**20):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"disk full: writing {Path(output).resolve()} failed ({first}); {fmt(free)} are free on that file "
            "system; nothing was written (free space, or choose another --out-dir)"
        )
    return None


def run_main(body: Callable[[], int], output: Optional[str] = None) -> int:
    """Run a tool's body; print a ``ToolError`` (or a bad-input error) as ``error: ...`` and return 1.
    ``output`` (the ``--out-dir``) lets a write that ran out of space be reported as a full disk."""
    # torchrun (when another rank fails) and schedulers stop ranks with SIGTERM: unwind, so the
    # temporary output is removed.

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return body()
    except (ToolError, OSError, RuntimeError, *_EXPECTED_ERRORS) as exc:
        full = _disk_full_message(exc, output)
        if full is None and not isinstance(exc, (ToolError, *_EXPECTED_ERRORS)):
            raise
        prefix = f"[rank {os.environ['RANK']}] " if under_torchrun() and os.environ["RANK"] != "0" else ""
        print(f"{prefix}error: {full or exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if under_torchrun():
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def exit_now(code: int) -> None:
    """End a converter's process with ``code`` as soon as its work is done: flush the output, run
    the ``atexit`` handlers (multiprocessing's clean-up among them), then ``os._exit``. Skipped is
    only the interpreter's teardown of torch / transformers / Megatron (seconds of freeing objects
    one by one, the memory goes back with the process anyway). For ``if __name__ == "__main__"``."""
    import atexit

    try:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def side_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer / generation-config / config.json files present in ``directory``."""
    return [Path(directory) / n for n in SIDE_FILES if (Path(directory) / n).is_file()]


def copy_files(files: list[Path], dest: Path) -> None:
    """Copy ``files`` into ``dest`` (created), keeping their names."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, dest / f.name)


def dir_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ------------------------------------------------------------------------------------------
# Tokenizer.
# ------------------------------------------------------------------------------------------
def load_tokenizer(directory: str | os.PathLike):
    """The HF tokenizer saved in ``directory`` (no hub access), or None if it holds none or it
    cannot be loaded here (then a warning says its size goes unchecked)."""
    if not any(
        (Path(directory) / n).is_file()
        for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that needs remote code
        if is_driver():
            print(
                f"warning: cannot load the tokenizer in {directory} ({type(exc).__name__}: {exc}); its size is "
                f"not checked against the model's vocabulary",
                file=sys.stderr,
                flush=True,
            )
        return None


_PLAIN_TOKENIZER_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
"""``tokenizer_class`` values whose ``len()`` is the ``tokenizer.json`` backend's size plus the tokens
its config names (classes of their own may add defaults of their own: those go through transformers)."""


def _named_tokens(config: dict) -> Optional[list[tuple[str, Optional[int]]]]:
    """(content, id or None) of every token ``tokenizer_config.json`` names; None if one is unreadable."""
    tokens: list[tuple[str, Optional[int]]] = []

    def add(value: Any, token_id: Optional[int] = None) -> bool:
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            return False
        tokens.append((value, token_id))
        return True

    for key, value in config.items():
        if key.endswith("_token") and value is not None and not add(value):
            return None
    for key in ("additional_special_tokens", "extra_special_tokens"):
        values = config.get(key) or []
        values = values.values() if isinstance(values, dict) else values
        if not all(add(v) for v in values):
            return None
    for token_id, value in (config.get("added_tokens_decoder") or {}).items():
        if not str(token_id).isdigit() or not add(value, int(token_id)):
            return None
    return tokens


class FastEncoder:
    """``encode(text, add_special_tokens=False)`` of a ``tokenizer.json`` through the ``tokenizers``
    library alone: what a plain fast transformers tokenizer runs underneath (``fast_tokenizer_size``'s
    cases), without transformers' tokenizer import (seconds, and ~0.1 GiB in the driver)."""

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of ``text``."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids


def fast_tokenizer_size(directory: str | os.PathLike) -> Optional[int]:
    """``len(AutoTokenizer.from_pretrained(directory))`` read from ``tokenizer.json`` with the
    ``tokenizers`` library alone (transformers' tokenizer import costs seconds), where it is sure to be
    the same: a ``tokenizer.json``, no remote code, a plain fast ``tokenizer_class``, and every token its
    ``tokenizer_config.json`` names already in the vocabulary at its id (transformers would add the
    others). None otherwise: the caller loads the tokenizer with transformers (``load_tokenizer``)."""
    import json

    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        return None
    try:
        config = (
            json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        )
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(d / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - unreadable here: transformers decides (and warns)
        return None
    if (
        not isinstance(config, dict)
        or "auto_map" in config
        or config.get("tokenizer_class") not in _PLAIN_TOKENIZER_CLASSES
    ):
        return None
    tokens = _named_tokens(config)
    if tokens is None:
        return None
    for content, token_id in tokens:
        found = backend.token_to_id(content)
        if found is None or (token_id is not None and found != token_id):
            return None
    return backend.get_vocab_size(with_added_tokens=True)


def fast_hf_config(config_dict: dict):
    """``megatron_rl.models.families.load_hf_config(config_dict)`` -- the same transformers config
    class, defaults and checks -- without the seconds transformers spends on generated docstrings:
    a config class's ``@auto_docstring`` imports the modeling auto-classes (and with them
    ``transformers.generation``) only to write its ``__doc__``. While the class is first imported,
    the decorator leaves the class as it is (its only other effect: ``cls.__doc__`` stays the source's)."""
    import transformers.utils as tf_utils

    from megatron_rl.models.families import load_hf_config

    real = tf_utils.auto_docstring

    def plain(obj=None, **_):
        return obj if obj is not None else (lambda o: o)

    tf_utils.auto_docstring = plain
    try:
        return load_hf_config(config_dict)
    finally:
        tf_utils.auto_docstring = real


def check_tokenizer(tokenizer, vocab_size: int, where: str | os.PathLike) -> Optional[int]:
    """``len(tokenizer)`` (``tokenizer`` may be that size already, ``fast_tokenizer_size``); a
    ``ToolError`` if it produces ids the embedding has no rows for."""
    if tokenizer is None:
        return None
    size = tokenizer if isinstance(tokenizer, int) else len(tokenizer)
    if size > vocab_size:
        raise ToolError(
            f"the tokenizer in {where} has {size} tokens (ids up to {size - 1}) but the model's "
            f"vocab_size is {vocab_size} (config.json): ids >= {vocab_size} have no embedding row; "
            f"use the tokenizer the model was trained with"
        )
    return size


def under_torchrun() -> bool:
    """True when this process is one rank of a torchrun (or similar) launch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def is_driver() -> bool:
    """The process that owns the output directory: the launcher, or rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True

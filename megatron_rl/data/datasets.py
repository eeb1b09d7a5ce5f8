"""Prompt datasets for RL: parquet/jsonl files in verl's layout -> left-padded prompt batches.

A row has verl's columns (``examples/data_preprocess/gsm8k.py`` writes them)::

    prompt        [{"role": "user", "content": "..."}, ...]  or a plain string (one user turn)
    data_source   "openai/gsm8k"  (picks the rule reward; ``data.reward_fn_key``)
    reward_model  {"style": "rule", "ground_truth": "72"}
    extra_info    {"split": "train", "index": 0, ...}   (optional)

``PromptDataset`` loads the files with HF ``datasets``, applies the tokenizer's chat template
(``add_generation_prompt=True``) and tokenizes every prompt once, then drops or rejects prompts
longer than ``max_prompt_length`` (verl's ``filter_overlong_prompts`` / ``truncation``).
``PromptDataLoader`` draws batches in a seeded order that depends only on ``(seed, epoch)``, so
its position (epoch, batch) is the whole resumable state; batches are left-padded
``input_ids`` / ``attention_mask`` / ``position_ids`` ``[b, P]`` plus per-prompt lists (``uid``,
``data_source``, ``ground_truth``, ``extra_info``, ...), ready for ``VLLMRollout.generate``.

``make_toy_dataset`` writes the built-in toy tasks (scored by ``megatron_rl.data.rewards``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from megatron_rl.utils.config_access import cfg_get
from megatron_rl.utils.registry import Registry

__all__ = [
    "TOY_TASKS",
    "toy_rows",
    "make_toy_dataset",
    "PromptDataset",
    "inspect_data_file",
    "column_values",
    "collate_prompts",
    "PromptDataLoader",
    "build_prompt_dataloader",
]

_TRUNCATION = ("error", "left", "right", "middle")

# ----------------------------------------------------------------------------- toy tasks
TOY_TASKS = Registry("toy task")
"""Toy task name -> ``fn(rng, length) -> (question, answer)``; the reward of the same name in
``megatron_rl.data.rewards`` scores it. Answers are digit strings separated by single spaces."""


def _digit_string(digits: Sequence[int]) -> str:
    return " ".join(str(int(d)) for d in digits)


@TOY_TASKS.register("toy_copy")
def _toy_copy(rng: np.random.Generator, length: int) -> tuple[str, str]:
    seq = _digit_string(rng.integers(0, 10, size=length))
    return f"Copy: {seq}", seq


@TOY_TASKS.register("toy_reverse")
def _toy_reverse(rng: np.random.Generator, length: int) -> tuple[str, str]:
    digits = rng.integers(0, 10, size=length)
    return f"Reverse: {_digit_string(digits)}", _digit_string(digits[::-1])


@TOY_TASKS.register("toy_count")
def _toy_count(rng: np.random.Generator, length: int) -> tuple[str, str]:
    # The counted digit fills each slot with probability 0.4, so counts spread over 0..length.
    digit = int(rng.integers(0, 10))
    others = (digit + rng.integers(1, 10, size=length)) % 10
    digits = np.where(rng.random(length) < 0.4, digit, others)
    return f"Count {digit} in: {_digit_string(digits)}", str(int((digits == digit).sum()))


def toy_rows(
    name: str, num_samples: int, seed: int = 0, *, min_len: int = 3, max_len: int = 5, split: str = "train"
) -> list[dict]:
    """``num_samples`` verl-layout rows of toy task ``name`` (digit sequences of ``min_len..max_len``).

    ``extra_info`` also carries ``question`` and ``answer`` (the exact target, for SFT warm-up).
    The rows depend only on the arguments.
    """
    task = TOY_TASKS[name]
    if num_samples <= 0:
        raise ValueError(f"num_samples={num_samples} must be > 0")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_samples):
        question, answer = task(rng, int(rng.integers(min_len, max_len + 1)))
        rows.append(
            {
                "data_source": name,
                "prompt": [{"role": "user", "content": question}],
                "ability": "toy",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": i, "question": question, "answer": answer},
            }
        )
    return rows


def make_toy_dataset(
    name: str, num_samples: int, seed: int = 0, path: str | Path = "toy.parquet", **kwargs: Any
) -> Path:
    """Write ``toy_rows(name, num_samples, seed, **kwargs)`` to ``path`` (``.parquet`` or
    ``.jsonl``/``.json``) and return the path."""
    path = Path(path)
    rows = toy_rows(name, num_samples, seed, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    elif path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"path={str(path)!r} must end in .parquet, .jsonl or .json")
    return path


# ----------------------------------------------------------------------------- the dataset
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
_SHOWN_ROWS = 5


def _prompt_is_empty(prompt: Any) -> bool:
    """True for a prompt with no text: None, a blank string, or messages whose contents are all blank."""
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, Sequence) and prompt:  # [] and messages without content are malformed, not empty
        return all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) and not m["content"].strip() for m in prompt
        )
    return False


def _empty_prompt_error(path: str, where: str, empty: list[int], total: int, prompt_key: str) -> ValueError:
    shown = ", ".join(str(i) for i in empty[:_SHOWN_ROWS]) + (", ..." if len(empty) > _SHOWN_ROWS else "")
    return ValueError(
        f"data file {path!r}: {len(empty)} of {total} prompts (column {prompt_key!r}) are empty "
        f"({where} {shown}); an empty prompt gives the model nothing to answer -- remove those rows"
    )


def _json_rows(path: Path) -> list[tuple[int, dict]]:
    """``(line, row)`` of a ``.jsonl`` file (or of a ``.json`` array); ``ValueError`` naming the line
    that is not UTF-8 text, not JSON or not an object."""
    raw = path.read_bytes()
    if path.suffix == ".json" and raw.lstrip()[:1] == b"[":  # one JSON array instead of one object per line
        try:
            rows = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise ValueError(
                f"data file {str(path)!r} line {line}: not UTF-8 text (byte {exc.start} of the file is "
                f"{raw[exc.start : exc.start + 1]!r}); save it as UTF-8"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"data file {str(path)!r} line {exc.lineno}: not valid JSON ({exc.msg})") from None
        return [(i + 1, row) for i, row in enumerate(rows)]
    out = []
    for number, line in enumerate(raw.split(b"\n"), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"data file {str(path)!r} line {number}: not UTF-8 text (byte {exc.start} of the line is "
                f"{line[exc.start : exc.start + 1]!r}); save the file as UTF-8"
            ) from None
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"data file {str(path)!r} line {number}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"data file {str(path)!r} line {number}: a row must be a JSON object, got {type(row).__name__}"
            )
        out.append((number, row))
    return out


def inspect_data_file(path: str | Path, columns: Sequence[str] = ("prompt",), *, prompt_key: str = "prompt") -> int:
    """Check one prompt file before anything loads it and return its number of rows.

    ``ValueError`` naming the file (and the row or line) when it has an unsupported suffix, does not
    exist, is a directory, cannot be read, is empty, is not parquet/JSON, is not UTF-8 text, lacks
    one of ``columns`` (the available ones are listed), or holds empty prompts in ``prompt_key``.
    """
    path = Path(path).expanduser()
    name = str(path)
    if path.suffix not in _FORMATS:
        raise ValueError(
            f"data file {name!r}: unsupported format {path.suffix or '(no suffix)'!r}; use .parquet, .jsonl or .json"
        )
    if not path.exists():
        raise ValueError(f"data file {name!r} does not exist")
    if not path.is_file():
        raise ValueError(f"data file {name!r} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"data file {name!r} is not readable (permission denied)")
    if path.stat().st_size == 0:
        raise ValueError(f"data file {name!r} is empty (0 bytes)")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(str(path))
        except (pa.ArrowInvalid, OSError) as exc:
            raise ValueError(f"data file {name!r} is not a readable parquet file ({exc})") from None
        available = list(meta.schema_arrow.names)
        missing = [c for c in columns if c not in available]
        if missing:
            raise ValueError(f"data file {name!r} has no column {missing[0]!r}; available columns: {available}")
        if meta.metadata.num_rows == 0:
            raise ValueError(f"data file {name!r} has no rows")
        prompts = meta.read(columns=[prompt_key]).column(0).to_pylist() if prompt_key in available else []
        where, index = "rows", list(range(len(prompts)))
    else:
        rows = _json_rows(path)
        if not rows:
            raise ValueError(f"data file {name!r} has no rows (only blank lines)")
        for number, row in rows:
            missing = [c for c in columns if c not in row]
            if missing:
                raise ValueError(
                    f"data file {name!r} line {number} has no field {missing[0]!r}; fields there: {sorted(row)}"
                )
        prompts = [row.get(prompt_key) for _, row in rows]
        where, index = "lines", [number for number, _ in rows]
    empty = [index[i] for i, p in enumerate(prompts) if _prompt_is_empty(p)]
    if empty:
        raise _empty_prompt_error(name, where, empty, len(prompts), prompt_key)
    return len(prompts)


def column_values(path: str | Path, column: str) -> list:
    """The values of one column of a prompt file (``inspect_data_file`` it first); [] when absent."""
    path = Path(path).expanduser()
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(str(path))
        return meta.read(columns=[column]).column(0).to_pylist() if column in meta.schema_arrow.names else []
    return [row.get(column) for _, row in _json_rows(path)]


def _load_file(path: str, cache_dir: Optional[str]):
    import datasets

    suffix = Path(path).suffix
    if suffix not in _FORMATS:
        raise ValueError(f"data file {path!r}: unsupported format; use .parquet, .jsonl or .json")
    if not Path(path).is_file():
        raise ValueError(f"data file {path!r} does not exist")
    bars_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a "Generating train split" bar per file clutters the run log
    try:
        return datasets.load_dataset(_FORMATS[suffix], data_files=path, split="train", cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001 - HF's errors (DatasetGenerationError ...) name neither file nor row
        inspect_data_file(path, ())  # raises the named reason when it finds one
        raise ValueError(f"data file {path!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    finally:
        if bars_on:
            datasets.enable_progress_bars()


class PromptDataset(torch.utils.data.Dataset):
    """Tokenized prompts with their reward inputs, from parquet/jsonl files in verl's layout.

    Args:
        data_files: one path or a list (``data.train_files``).
        tokenizer: HF tokenizer; its chat template formats message-list prompts.
        config: verl's ``data`` section (DictConfig, dict or typed config). Keys read:
            ``prompt_key`` ("prompt"), ``reward_fn_key`` ("data_source"), ``max_prompt_length``
            (512), ``filter_overlong_prompts`` (False: drop longer prompts when True),
            ``truncation`` ("error" | "left" | "right" | "middle" for prompts still too long),
            ``apply_chat_template_kwargs`` ({}), ``shuffle``/``seed`` (for ``max_samples``),
            ``cache_dir`` (HF datasets cache; default HF's), and our ``apply_chat_template``
            (True; False encodes string prompts as they are, for base models).
        max_samples: keep this many rows (verl: a seeded random choice when ``shuffle``, else the
            first rows); -1 keeps all.
        require_ground_truth: the ``reward_model`` column must exist with a ``ground_truth``
            per row (rule rewards need it; a reward model does not).

    Raises:
        ValueError: a missing column (naming it and the available ones), a malformed prompt, or
            a prompt longer than ``max_prompt_length`` under ``truncation="error"`` (naming the
            file and row).
    """

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        config: Any = None,
        *,
        max_samples: int = -1,
        require_ground_truth: bool = True,
    ):
        files = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
        if not files:
            raise ValueError("data_files is empty; give at least one .parquet/.jsonl file")
        self.files = [str(f) for f in files]
        self.tokenizer = tokenizer
        self.prompt_key = cfg_get(config, "prompt_key", "prompt")
        self.reward_fn_key = cfg_get(config, "reward_fn_key", "data_source")
        self.max_prompt_length = int(cfg_get(config, "max_prompt_length", 512))
        self.filter_overlong_prompts = bool(cfg_get(config, "filter_overlong_prompts", False))
        self.truncation = cfg_get(config, "truncation", "error")
        self.apply_chat_template = bool(cfg_get(config, "apply_chat_template", True))
        self.chat_template_kwargs = dict(cfg_get(config, "apply_chat_template_kwargs", {}) or {})
        if self.truncation not in _TRUNCATION:
            raise ValueError(f"data.truncation={self.truncation!r}; allowed: {list(_TRUNCATION)}")
        if self.max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} must be > 0")

        rows = self._read(cfg_get(config, "cache_dir"), require_ground_truth)
        if 0 < max_samples < len(rows):
            if cfg_get(config, "shuffle", False):
                seed = cfg_get(config, "seed")
                keep = np.random.default_rng(*(() if seed is None else (seed,))).choice(
                    len(rows), size=max_samples, replace=False
                )
            else:
                keep = np.arange(max_samples)
            rows = [rows[int(i)] for i in keep]
        self.num_filtered = 0
        self.rows: list[dict] = []
        for row in rows:
            ids = self._tokenize(row)
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                ids = self._truncate(ids, row["origin"])
            row["input_ids"] = ids
            self.rows.append(row)
        if not self.rows:
            raise ValueError(
                f"no prompts left in {self.files}: all {len(rows)} rows are longer than "
                f"data.max_prompt_length={self.max_prompt_length}"
            )

    def _read(self, cache_dir: Optional[str], require_ground_truth: bool) -> list[dict]:
        required = [self.prompt_key, self.reward_fn_key] + (["reward_model"] if require_ground_truth else [])
        rows: list[dict] = []
        for path in self.files:
            table = _load_file(path, cache_dir)
            columns = list(table.column_names)
            for name in required:
                if name not in columns:
                    raise ValueError(f"data file {path!r} has no column {name!r}; available columns: {columns}")
            prompts = list(table[self.prompt_key])
            if not prompts:
                raise ValueError(f"data file {path!r} has no rows")
            empty = [i for i, p in enumerate(prompts) if _prompt_is_empty(p)]
            if empty:
                raise _empty_prompt_error(path, "rows", empty, len(prompts), self.prompt_key)
            sources = list(table[self.reward_fn_key])
            reward_models = list(table["reward_model"]) if "reward_model" in columns else [None] * len(prompts)
            extra_infos = list(table["extra_info"]) if "extra_info" in columns else [None] * len(prompts)
            for i, (prompt, source, rm, extra) in enumerate(zip(prompts, sources, reward_models, extra_infos)):
                origin = f"{path} row {i}"
                truth = rm.get("ground_truth") if isinstance(rm, Mapping) else None
                if require_ground_truth and truth is None:
                    raise ValueError(f"{origin}: reward_model.ground_truth is missing (reward_model={rm!r})")
                rows.append(
                    {
                        "origin": origin,
                        "raw_prompt": self._messages(prompt, origin),
                        "data_source": source,
                        "ground_truth": truth,
                        "extra_info": dict(extra) if extra else {},
                    }
                )
        return rows

    def _messages(self, prompt: Any, origin: str) -> list[dict] | str:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}] if self.apply_chat_template else prompt
        if not self.apply_chat_template:
            raise ValueError(
                f"{origin}: column {self.prompt_key!r} holds a message list but "
                "data.apply_chat_template=False; give plain strings or enable the template"
            )
        if (
            not isinstance(prompt, Sequence)
            or not prompt
            or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            raise ValueError(
                f"{origin}: column {self.prompt_key!r} must be a string or a non-empty list of "
                f"{{'role': str, 'content': str}} messages, got {prompt!r}"
            )
        return [{"role": m["role"], "content": m["content"]} for m in prompt]

    def _tokenize(self, row: dict) -> list[int]:
        prompt = row["raw_prompt"]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template; set one or use data.apply_chat_template=False with string prompts"
            )
        text = self.tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _truncate(self, ids: list[int], origin: str) -> list[int]:
        limit = self.max_prompt_length
        if self.truncation == "error":
            raise ValueError(
                f"{origin}: prompt has {len(ids)} tokens, more than data.max_prompt_length={limit}; "
                "set data.filter_overlong_prompts=True to drop such rows or "
                "data.truncation=left|right|middle to cut them"
            )
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        head = limit // 2  # "middle": keep the start and the end, as verl does
        return ids[:head] + ids[len(ids) - (limit - head) :]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        """Row ``i``: ``input_ids`` (list), ``raw_prompt``, ``data_source``, ``ground_truth``,
        ``extra_info``, ``index`` (``extra_info["index"]``, verl's) and ``row`` (``i``)."""
        row = self.rows[i]
        index = row["extra_info"].get("index")
        return {
            "input_ids": row["input_ids"],
            "raw_prompt": row["raw_prompt"],
            "data_source": row["data_source"],
            "ground_truth": row["ground_truth"],
            "extra_info": row["extra_info"],
            "index": i if index is None else index,
            "row": i,
        }


def collate_prompts(
    items: Sequence[Mapping], pad_token_id: int, *, pad_to: Optional[int] = None, uids: Optional[Sequence[str]] = None
) -> dict[str, Any]:
    """Left-pad ``items`` (``PromptDataset`` rows) into a batch.

    Returns ``input_ids``, ``attention_mask``, ``position_ids`` ``[b, P]`` (``P`` = the longest
    prompt, or ``pad_to``) and the lists ``uid``, ``raw_prompt``, ``data_source``,
    ``ground_truth``, ``extra_info``, ``index``, ``row``.
    """
    if not items:
        raise ValueError("cannot collate an empty list of prompts")
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    width = int(lengths.max()) if pad_to is None else int(pad_to)
    if int(lengths.max()) > width:
        raise ValueError(f"a prompt has {int(lengths.max())} tokens, more than pad_to={width}")
    input_ids = torch.full((len(items), width), int(pad_token_id), dtype=torch.long)
    for j, it in enumerate(items):
        if it["input_ids"]:
            input_ids[j, width - len(it["input_ids"]) :] = torch.tensor(it["input_ids"], dtype=torch.long)
    attention_mask = (torch.arange(width) >= width - lengths[:, None]).long()  # [b, P]
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "uid": list(uids) if uids is not None else [str(it["row"]) for it in items],
    }
    for key in ("raw_prompt", "data_source", "ground_truth", "extra_info", "index", "row"):
        batch[key] = [it[key] for it in items]
    return batch


# ----------------------------------------------------------------------------- the loader
class PromptDataLoader:
    """Batches of a ``PromptDataset`` in a seeded order, with a resumable position.

    Epoch ``e`` visits the rows in ``permutation(seed, e)`` order (``range(N)`` without
    ``shuffle``), so the order never depends on how the loader got there: ``state_dict()`` (the
    next batch's epoch and index) restores the exact stream. After an epoch's last batch the
    position moves to batch 0 of the next epoch.

    ``uid`` of a prompt is ``"<epoch>-<row>"``: unique within and across batches and the same
    after a resume (verl draws random uuid4s).

    Args:
        dataset: the ``PromptDataset`` (anything with ``__len__`` / ``__getitem__`` rows).
        batch_size: prompts per batch (``data.train_batch_size`` or ``gen_batch_size``).
        shuffle / seed: verl's ``data.shuffle`` / ``data.seed`` (None -> 0).
        drop_last: drop the last partial batch of an epoch (verl's train loader does).
        pad_token_id: pad id (default: the dataset tokenizer's pad id, else its eos id).
        pad_to: fixed prompt width (e.g. ``max_prompt_length``); default the longest in the batch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: Optional[int] = 0,
        drop_last: bool = True,
        pad_token_id: Optional[int] = None,
        pad_to: Optional[int] = None,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be > 0")
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.shuffle, self.seed, self.drop_last, self.pad_to = bool(shuffle), int(seed or 0), bool(drop_last), pad_to
        self.num_samples = len(dataset)
        if self.num_batches == 0:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({self.num_samples} prompts) "
                "with drop_last=True; no batch could be drawn"
            )
        if pad_token_id is None:
            tok = getattr(dataset, "tokenizer", None)
            pad_token_id = getattr(tok, "pad_token_id", None)
            pad_token_id = getattr(tok, "eos_token_id", None) if pad_token_id is None else pad_token_id
        if pad_token_id is None:
            raise ValueError("no pad_token_id given and the dataset's tokenizer has neither a pad nor an eos id")
        self.pad_token_id = int(pad_token_id)
        self.epoch, self.batch_in_epoch = 0, 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def num_batches(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.num_batches

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                if self.shuffle
                else np.arange(self.num_samples)
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self) -> dict[str, Any]:
        """The batch at the current position; advance (into the next epoch after the last one)."""
        epoch, start = self.epoch, self.batch_in_epoch * self.batch_size
        rows = self._order(epoch)[start : start + self.batch_size].tolist()
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.num_batches:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
        items = [self.dataset[r] for r in rows]
        return collate_prompts(items, self.pad_token_id, pad_to=self.pad_to, uids=[f"{epoch}-{r}" for r in rows])

    def __iter__(self):
        """The remaining batches of the current epoch (all of them from a fresh position)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position and the settings the order depends on (checked by ``load_state_dict``)."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s position; the order-defining settings must match this loader's."""
        for key in ("seed", "shuffle", "batch_size", "num_samples", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"dataloader state has {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; resuming would replay a different data order"
                )
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        if epoch < 0 or not 0 <= batch < self.num_batches:
            raise ValueError(
                f"dataloader state position epoch={epoch}, batch_in_epoch={batch} is out of range "
                f"(0 <= batch_in_epoch < {self.num_batches})"
            )
        self.epoch, self.batch_in_epoch = epoch, batch


def build_prompt_dataloader(
    data_files: Any, tokenizer: Any, config: Any, *, batch_size: Optional[int] = None, **dataset_kwargs: Any
) -> PromptDataLoader:
    """``PromptDataset`` + ``PromptDataLoader`` from verl's ``data`` config keys
    (``gen_batch_size`` or ``train_batch_size``, ``shuffle``, ``seed``)."""
    dataset = PromptDataset(data_files, tokenizer, config, **dataset_kwargs)
    size = batch_size or cfg_get(config, "gen_batch_size") or cfg_get(config, "train_batch_size")
    if size is None:
        raise ValueError("no batch size: pass batch_size or set data.train_batch_size")
    if int(size) > len(dataset):
        key = "data.gen_batch_size" if cfg_get(config, "gen_batch_size") and not batch_size else "data.train_batch_size"
        raise ValueError(
            f"{key}={size} is larger than the dataset: {len(dataset)} prompts in {dataset.files} "
            "(after data.train_max_samples / data.filter_overlong_prompts); no batch could be drawn"
        )
    return PromptDataLoader(
        dataset, int(size), shuffle=bool(cfg_get(config, "shuffle", True)), seed=cfg_get(config, "seed", 0)
    )

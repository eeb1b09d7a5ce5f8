"""vLLM's LoRA slot of a ``VLLMRollout``: the adapter-only weight sync of ``lora.merge: false`` (issue 29).

With ``max_lora_rank`` (or ``engine_kwargs.vllm.enable_lora``, which the trainer sets for ``lora.merge:
false``: ``config.lora_config.vllm_lora_engine_kwargs``) the engine is built with one LoRA slot (``max_loras=1``);
``load_lora_tensors`` / ``load_lora_adapter`` put the actor's PEFT adapter in it, the base weights
untouched, and every later generation uses it (``lora_request``). ``VLLMLoRA`` is the part of
``megatron_rl.rollout.vllm_rollout.VLLMRollout`` that does this; it uses the engine's ``llm``,
``config``, ``_world`` and ``reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from megatron_rl.config.lora_config import vllm_lora_rank

__all__ = ["VLLMLoRA"]


class VLLMLoRA:
    """The LoRA methods of ``VLLMRollout`` (a base class: the engine itself is the subclass's)."""

    def _init_lora(self, max_lora_rank: int) -> None:
        """Before the engine is built: the slot's rank. 0: no LoRA; else vLLM's slot rank >= the adapters'
        (the argument, or ``engine_kwargs.vllm``'s ``enable_lora`` and ``max_lora_rank``)."""
        engine_vllm = self.config.engine_kwargs.get("vllm") or {}
        if not max_lora_rank and engine_vllm.get("enable_lora"):
            max_lora_rank = int(engine_vllm.get("max_lora_rank", 16))  # vLLM's default
        self.max_lora_rank = vllm_lora_rank(max_lora_rank)
        self._lora_request = None  # the adapter every generation uses (``load_lora_adapter``)
        self._lora_dir: Path | None = None  # the directory ``load_lora_tensors`` wrote it to

    def _lora_engine_kwargs(self) -> dict[str, Any]:
        """The ``vllm.LLM`` arguments of the slot: one adapter, the actor's current one (``{}`` without LoRA)."""
        if not self.max_lora_rank:
            return {}
        return {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": 1}

    def _drop_lora_dir(self) -> None:
        """Remove the directory the last ``load_lora_tensors`` wrote (at shutdown)."""
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None

    def load_lora_adapter(self, adapter_dir: str | os.PathLike) -> dict[str, Any]:
        """Make the PEFT adapter directory ``adapter_dir`` the adapter every generation uses, the base
        weights untouched (``lora.merge: false``): vLLM loads it now (under a new adapter id, so nothing
        stale is reused; the previous adapter is dropped) and the prefix cache is reset. Needs an engine
        built with ``max_lora_rank`` >= the adapter's ``r``. Returns ``{"bytes", "seconds", "lora_int_id"}``
        (``bytes``: the adapter's safetensors file, what vLLM read)."""
        from vllm.lora.request import LoRARequest

        if not self.max_lora_rank:
            raise ValueError(
                "load_lora_adapter: the engine was built without LoRA; build VLLMRollout with "
                "max_lora_rank >= the adapter's rank"
            )
        path = Path(adapter_dir)
        rank = int(json.loads((path / "adapter_config.json").read_text())["r"])
        if rank > self.max_lora_rank:
            raise ValueError(
                f"load_lora_adapter: the adapter's r={rank} exceeds the engine's max_lora_rank={self.max_lora_rank}"
            )
        start = time.perf_counter()
        previous = self._lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        request = LoRARequest(f"actor-{lora_id}", lora_id, str(path))
        with self._world.engine():
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"load_lora_adapter: vLLM did not load the adapter at {path}")
        self._lora_request = request
        self.reset_prefix_cache()
        return {
            "bytes": (path / "adapter_model.safetensors").stat().st_size,
            "seconds": time.perf_counter() - start,
            "lora_int_id": lora_id,
        }

    def load_lora_tensors(
        self, tensors: Mapping[str, torch.Tensor], shared: Mapping[str, Sequence[str]], peft_config: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Adapter-only weight sync (``lora.merge: false``): the actor's compact PEFT adapter
        (``megatron_rl.engine.lora_peft.peft_adapter_parts``: each tensor once, ``shared`` naming the
        HF modules that reuse a fused linear's ``A``) becomes the adapter every generation uses. It is
        made whole and written as a PEFT directory under ``checkpoint_engine.shm_dir`` (this machine's
        memory on Linux), which ``load_lora_adapter`` loads; the previous one is removed. Returns
        ``{"transport": "lora", "bytes", "num_tensors", "seconds"}`` (``bytes``: the adapter tensors
        received, each once)."""
        from megatron_rl.models.peft import expand_shared, write_peft_adapter

        start = time.perf_counter()
        root = Path(self.config.checkpoint_engine.shm_dir)
        root.mkdir(parents=True, exist_ok=True)
        path = write_peft_adapter(
            expand_shared(tensors, {k: tuple(v) for k, v in shared.items()}),
            dict(peft_config),
            root / f"lora-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        )
        try:
            self.load_lora_adapter(path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        self._lora_dir = path
        return {
            "transport": "lora",
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "num_tensors": len(tensors),
            "seconds": time.perf_counter() - start,
        }

    @property
    def lora_request(self):
        """The ``vllm.lora.request.LoRARequest`` generations use (None: the base model)."""
        return self._lora_request

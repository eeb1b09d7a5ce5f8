"""HF export of the trained actor: the bridge's export, gathered to actor rank 0, written atomically.

A LoRA actor's export is the merged model (``W + alpha/rank * B A`` under the HF names) with its
adapters beside it as a PEFT adapter directory, ``<hf dir>/lora_adapter`` (verl's model merger's
place and name): ``PeftModel.from_pretrained(<the starting checkpoint>, "<hf dir>/lora_adapter")``
gives the same model. ``save_lora_adapter`` writes the adapter alone.
"""

from __future__ import annotations

import shutil
import uuid
import warnings
from pathlib import Path

__all__ = ["save_hf_checkpoint", "save_lora_adapter"]

_COPIED_SUFFIXES = (".json", ".jinja", ".txt", ".model")


def save_hf_checkpoint(actor, model_path: str | Path, out_dir: str | Path, *, bucket_bytes: int) -> Path:
    """Write the actor worker group's weights as an HF checkpoint at ``out_dir`` with the starting
    checkpoint's (``model_path``) config, generation config and tokenizer files, and the starting
    checkpoint's multi-token-prediction tensors (not trained; copied unchanged); a LoRA actor adds its
    adapters as a PEFT adapter directory ``out_dir/lora_adapter``. Atomic: a temporary sibling
    directory is renamed into place; ``FileExistsError`` if ``out_dir`` exists."""
    import ray
    from safetensors.torch import save_file

    from megatron_rl.engine.lora_peft import ADAPTER_DIR_NAME, write_peft_adapter
    from megatron_rl.workers.weight_sync import export_weights
    from parallel.bridge.mtp import source_mtp_tensors

    final = Path(out_dir).resolve()
    if final.exists():
        raise FileExistsError(f"save_hf_checkpoint: {final} exists")
    # MTP layers of a DeepSeek-V3 / GLM-4.5 source: not trained (no MTP block), carried unchanged.
    mtp = source_mtp_tensors(model_path)
    weights = ray.get(export_weights(actor, bucket_bytes=bucket_bytes))
    adapter = _lora_adapter(actor, model_path, bucket_bytes, required=False)
    if isinstance(adapter, str):  # the merged model is still exported; only the adapter directory is missing
        warnings.warn(f"save_hf_checkpoint: {final / 'lora_adapter'} is not written: {adapter}", stacklevel=2)
        adapter = None
    clash = sorted({name for name, _ in weights} & set(mtp))
    if clash:
        raise ValueError(
            f"save_hf_checkpoint: the trained model exports {clash[:5]}, which are MTP tensors of {model_path}"
        )
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_file(
            {**{name: t.contiguous() for name, t in weights}, **mtp},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        for f in Path(model_path).iterdir():
            if f.is_file() and (
                f.suffix in _COPIED_SUFFIXES
                and not f.name.endswith(".safetensors.index.json")
                and f.name != "sft_warmup.json"
            ):
                shutil.copy(f, tmp / f.name)
        if adapter is not None:
            write_peft_adapter(*adapter, tmp / ADAPTER_DIR_NAME)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_lora_adapter(actor, model_path: str | Path, out_dir: str | Path, *, bucket_bytes: int) -> Path:
    """Write a LoRA actor worker group's adapters as a PEFT adapter directory at ``out_dir``
    (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's names; its base model is
    ``model_path``). Atomic; ``FileExistsError`` if ``out_dir`` exists, ``ValueError`` if the actor
    has no LoRA adapters."""
    from megatron_rl.engine.lora_peft import write_peft_adapter

    final = Path(out_dir).resolve()
    if final.exists():
        raise FileExistsError(f"save_lora_adapter: {final} exists")
    adapter = _lora_adapter(actor, model_path, bucket_bytes)
    if adapter is None:
        raise ValueError("save_lora_adapter: the actor has no LoRA adapters (actor_rollout_ref.model.lora.rank: 0)")
    return write_peft_adapter(*adapter, final)


def _lora_adapter(actor, model_path, bucket_bytes: int, *, required: bool = True):
    """Actor rank 0's ``(tensors, config)`` PEFT adapter, None without LoRA, or (``required=False``)
    why the adapters have no PEFT form (collective)."""
    import ray

    refs = [w.export_lora_adapter.remote(bucket_bytes, str(model_path), required=required) for w in actor.workers]
    return ray.get(refs)[0]

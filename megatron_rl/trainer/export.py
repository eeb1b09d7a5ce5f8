"""HF export of the trained actor: the bridge's export, gathered to actor rank 0, written atomically."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

__all__ = ["save_hf_checkpoint"]

_COPIED_SUFFIXES = (".json", ".jinja", ".txt", ".model")


def save_hf_checkpoint(actor, model_path: str | Path, out_dir: str | Path, *, bucket_bytes: int) -> Path:
    """Write the actor worker group's weights as an HF checkpoint at ``out_dir`` with the starting
    checkpoint's (``model_path``) config, generation config and tokenizer files, and the starting
    checkpoint's multi-token-prediction tensors (not trained; copied unchanged). Atomic: a temporary
    sibling directory is renamed into place; ``FileExistsError`` if ``out_dir`` exists."""
    import ray
    from safetensors.torch import save_file

    from megatron_rl.workers.weight_sync import export_weights
    from parallel.bridge.mtp import source_mtp_tensors

    final = Path(out_dir).resolve()
    if final.exists():
        raise FileExistsError(f"save_hf_checkpoint: {final} exists")
    # MTP layers of a DeepSeek-V3 / GLM-4.5 source: not trained (no MTP block), carried unchanged.
    mtp = source_mtp_tensors(model_path)
    weights = ray.get(export_weights(actor, bucket_bytes=bucket_bytes))
    clash = sorted({name for name, _ in weights} & set(mtp))
    if clash:
        raise ValueError(f"save_hf_checkpoint: the trained model exports {clash[:5]}, which are MTP tensors of "
                         f"{model_path}")
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_file({**{name: t.contiguous() for name, t in weights}, **mtp}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        for f in Path(model_path).iterdir():
            if f.is_file() and (f.suffix in _COPIED_SUFFIXES and not f.name.endswith(".safetensors.index.json")
                                and f.name != "sft_warmup.json"):
                shutil.copy(f, tmp / f.name)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final

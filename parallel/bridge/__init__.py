"""Hugging Face safetensors <-> Megatron-Core weights, for a model sharded any way (TP/PP/VPP/EP).

A model family describes its weights as data: ``WeightRule``s from a Megatron parameter name
(global layer and expert numbers, ``{layer}``/``{expert}`` placeholders) to HF tensor names,
with one of four transforms. This package knows how Megatron shards each transform and does the
I/O; it knows nothing about RL or about particular families (``megatron_rl.models.families``
builds the ``WeightMap`` of a family).

* ``load_hf_checkpoint(chunks, weight_map, hf_dir)``: every rank reads only the slices it owns
  (``safe_open(...).get_slice(name)[rows]``), so host memory stays near one shard.
* ``HFExporter(chunks, weight_map)`` plans once (collectively) what the full model looks like in
  HF names; ``.iter_weights(bucket_bytes=...)`` then yields ``(hf_name, tensor)`` bucket by
  bucket, gathering over TP/EP/PP only what the current bucket needs. ``export_hf_weights`` is
  the one-shot form. It feeds ``save_hf_checkpoint`` and weight sync to inference engines.
* ``save_hf_checkpoint`` streams safetensors shards + index + config.json into a temporary
  directory and renames it into place, so a failed save leaves nothing that looks complete.
* ``check_layout`` checks a parallel layout against a model before any process group exists.

Transforms (the full Megatron tensor is the concatenation of its TP shards along the
parameter's ``partition_dim``):

  ``copy``     same tensor
  ``vocab``    rows padded to the TP-padded vocabulary: zeros on import, dropped on export
  ``qkv``      HF q, k, v -> rows grouped per query group: [q heads of group 0, k0, v0, q heads
               of group 1, k1, v1, ...]; a TP shard is a contiguous run of those rows
  ``gate_up``  HF gate, up -> each TP shard is [gate rows of the shard; up rows of the shard]

Every function here is collective where it says so: call it on all ranks, in the same order,
and exhaust generators on every rank (ranks that yield nothing still move data). Errors are
raised on every rank alike. Process groups come from ``mesh`` (``parallel.mesh.Mesh``) or, if
None, from Megatron's parallel state; without ``torch.distributed`` everything runs as one rank.

Modules: ``rules`` (the data and the shard geometry), ``hf_files`` (validating sliced reader,
streaming safetensors writer), ``load``, ``export``, ``save``, ``collective``.

Typical use (all ranks)::

    family = get_family(hf_dir); model_cfg = family.model_config(hf_dir)
    weight_map = family.weight_map(model_cfg)
    load_hf_checkpoint(chunks, weight_map, hf_dir, mesh=mesh)
    ...train...
    save_hf_checkpoint(chunks, weight_map, out_dir, load_hf_config(hf_dir), mesh=mesh)
    exporter = HFExporter(chunks, weight_map, mesh=mesh, dtype=torch.bfloat16)  # weight sync
    for name, tensor in exporter.iter_weights(bucket_bytes=1 << 28, all_ranks=True): ...
"""

from parallel.bridge.export import DEFAULT_BUCKET_BYTES, ExportStats, HFExporter, export_hf_weights
from parallel.bridge.hf_files import HFCheckpointReader, HFTensorInfo
from parallel.bridge.load import LoadReport, load_hf_checkpoint
from parallel.bridge.rules import WeightMap, WeightRule, check_layout, global_param_name
from parallel.bridge.save import save_hf_checkpoint

__all__ = [
    "WeightRule",
    "WeightMap",
    "HFCheckpointReader",
    "HFTensorInfo",
    "HFExporter",
    "ExportStats",
    "LoadReport",
    "load_hf_checkpoint",
    "export_hf_weights",
    "save_hf_checkpoint",
    "check_layout",
    "global_param_name",
    "DEFAULT_BUCKET_BYTES",
]

"""FP8 block-quantised DeepSeek-V3 checkpoints (issue 20): the published format (``float8_e4m3fn``
weights + float32 ``weight_scale_inv`` per block, ``quantization_config`` in config.json) is
dequantised on load to the training dtype, equal to transformers' own dequantisation
(``integrations.finegrained_fp8.Fp8Dequantize``); a Megatron model loaded from it exports exactly
those tensors; inconsistent scales are refused by name before anything is loaded or written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.models.test_families import read_hf_tensors

_QUANTISED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*_proj\.weight")  # DeepSeek-V3's FP8 linears


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``src`` (a float32 HF checkpoint) re-saved block-quantised as DeepSeek-V3 publishes it;
    returns the written tensors (FP8 weights and their scales included)."""
    from safetensors.torch import save_file

    from parallel.bridge.fp8 import quantize_fp8_blocks

    dst.mkdir(parents=True)
    out = {}
    for name, tensor in read_hf_tensors(src).items():
        if _QUANTISED.fullmatch(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(tensor, block)
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("fp8") / "hf", "deepseek_v3")["path"]


def test_dequantisation_equals_transformers(tiny_deepseek, tmp_path):
    """Whole blocks (16 x 16 divides every quantised weight): the reader's tensors equal
    transformers' ``Fp8Dequantize`` on the same (weight, scale) pairs, bit for bit, and sliced
    reads (rows and columns, starting mid-block) equal slices of the whole."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from parallel.bridge import HFCheckpointReader
    from parallel.bridge.fp8 import open_dequantizing

    written = write_fp8_checkpoint(tiny_deepseek, tmp_path / "fp8", (16, 16))
    fp8 = [n for n in written if written[n].dtype == torch.float8_e4m3fn]
    assert len(fp8) >= 20 and any("kv_b_proj" in n for n in fp8) and any("experts.3.down_proj" in n for n in fp8)
    hf = Fp8Dequantize(None)
    with open_dequantizing(HFCheckpointReader(tmp_path / "fp8"), tmp_path / "fp8") as reader:
        assert sorted(reader.keys()) == sorted(n for n in written if not n.endswith("_scale_inv"))
        for name in fp8:
            ours = reader.read(name)
            theirs = hf._dequantize_one(written[name], written[name + "_scale_inv"], torch.float32)
            assert ours.dtype == torch.float32 and torch.equal(ours, theirs), name
            rows, cols = ours.shape
            assert torch.equal(reader.read(name, 0, 5, rows - 3), ours[5 : rows - 3]), name
            assert torch.equal(reader.read(name, 1, 7, cols), ours[:, 7:]), name
        assert torch.equal(reader.read("model.norm.weight"), written["model.norm.weight"])  # unquantised as is
    # Quantisation error is FP8's (3 mantissa bits): relative error per element <= 2^-4.
    source = read_hf_tensors(tiny_deepseek)
    name = fp8[0]
    deq = hf._dequantize_one(written[name], written[name + "_scale_inv"], torch.float32)
    assert 0 < float((deq - source[name]).abs().max()) <= float(source[name].abs().max()) / 16


def _load_export(rank, world_size, hf_dir, model_cfg):
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import export_hf_weights, load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig(tensor_model_parallel_size=world_size)
    mesh = init_mesh(pc, seed=1)
    chunks = build_model(model_cfg, build_transformer_config(model_cfg, pc))
    weight_map = get_family(hf_dir).weight_map(model_cfg)
    try:
        load_hf_checkpoint(chunks, weight_map, hf_dir, mesh=mesh)
    except ValueError as exc:
        return str(exc)
    return {n: t.clone() for n, t in export_hf_weights(chunks, weight_map, mesh=mesh, all_ranks=True)}


def test_megatron_loads_fp8_checkpoint_at_tp2(tiny_deepseek, tmp_path):
    """A 32 x 24 block (partial blocks at the edges; TP shards start mid-block): the TP=2 model
    holds exactly the reference dequantisation (``weight * scale_inv`` per block) of every FP8
    weight, and the other tensors unchanged."""
    from megatron_rl.models.families import get_family

    block = (32, 24)
    written = write_fp8_checkpoint(tiny_deepseek, tmp_path / "fp8", block)
    model_cfg = get_family(tmp_path / "fp8").model_config(tmp_path / "fp8")
    got = run_distributed(_load_export, 2, str(tmp_path / "fp8"), model_cfg, timeout_s=300)[0]
    assert isinstance(got, dict), got
    assert sorted(got) == sorted(n for n in written if not n.endswith("_scale_inv"))
    for name, tensor in written.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:  # the published formula, written out
            scale = written[name + "_scale_inv"]
            full = scale.repeat_interleave(block[0], 0)[: tensor.shape[0]].repeat_interleave(block[1], 1)
            tensor = tensor.float() * full[:, : tensor.shape[1]]
        assert torch.equal(got[name], tensor.float()), name


@pytest.mark.parametrize(
    "fault,message",
    [
        (
            "missing",
            "'model.layers.1.self_attn.kv_b_proj.weight' is FP8 but "
            "'model.layers.1.self_attn.kv_b_proj.weight_scale_inv' is missing",
        ),
        (
            "shape",
            "'model.layers.1.self_attn.kv_b_proj.weight_scale_inv' has shape [1, 1]; "
            "'model.layers.1.self_attn.kv_b_proj.weight' [128, 512] in [16, 16] blocks needs [8, 32]",
        ),
    ],
)
def test_bad_fp8_scales_are_refused_by_name(tiny_deepseek, tmp_path, fault, message):
    from safetensors.torch import load_file, save_file

    from megatron_rl.models.families import get_family

    write_fp8_checkpoint(tiny_deepseek, tmp_path / "fp8", (16, 16))
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    scale = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    if fault == "missing":
        del tensors[scale]
    else:
        tensors[scale] = torch.ones(1, 1)
    save_file(tensors, str(path))
    model_cfg = get_family(tmp_path / "fp8").model_config(tmp_path / "fp8")
    msg = run_distributed(_load_export, 1, str(tmp_path / "fp8"), model_cfg, timeout_s=300)[0]
    assert (
        isinstance(msg, str)
        and "FP8 block-quantised checkpoint (weight_block_size=[16, 16]) is inconsistent" in msg
        and message in msg
    ), msg


def test_unsupported_quantization_config_is_named():
    from parallel.bridge.fp8 import fp8_block_size

    assert fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == (
        128,
        128,
    )
    assert fp8_block_size({}) is None
    with pytest.raises(ValueError, match="quant_method='awq' is not supported; allowed: 'fp8'"):
        fp8_block_size({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match=r"weight_block_size=\[128\] is not supported"):
        fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})


def test_export_config_drops_the_quantization_config(tmp_path):
    """mcore -> HF writes dequantised tensors: config.json must not keep an FP8 source's
    ``quantization_config`` (a loader would read the plain weights as block-quantised)."""
    from megatron_rl.convert.mcore_to_hf import _config_text

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}})
    )
    config = json.loads(_config_text({"dtype": "bfloat16", "hf_config": {}}, tmp_path))
    assert config == {"model_type": "deepseek_v3", "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "dtype": "float32"}) + "\n")
    assert json.loads(_config_text({"dtype": "bfloat16", "hf_config": {}}, tmp_path))["dtype"] == "bfloat16"

"""FP8 export of DeepSeek-V3 (issue 20): ``megatron-rl convert mcore-to-hf --export-fp8`` writes
DeepSeek-V3's published block format back (``float8_e4m3fn`` weights + float32 ``weight_scale_inv``
per block, ``quantization_config`` in config.json) for exactly the tensors the source quantised.

- FP8 source -> Megatron -> FP8 export gives the source's bytes back, every tensor (MTP layer included).
- A plain source quantised afresh (``FP8_WEIGHTS``, 128 x 128 blocks): transformers' own
  dequantisation (``Fp8Dequantize``) of the export equals the plain tensors within FP8 e4m3's
  rounding, |deq - w| <= max(2^-4 |w|, 2^-10 scale) per element (3 mantissa bits: half an ulp is
  2^-4 relative for normal values; subnormals are spaced 2^-9 * scale).
- Blocks that changed are quantised afresh; unchanged blocks keep the source's scale.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.megatron_rl.models.test_deepseek_fp8 import write_fp8_checkpoint
from tests.megatron_rl.models.test_families import read_hf_tensors

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "megatron_rl.cli", "convert"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("fp8x") / "hf", "deepseek_v3", mtp_layers=1)["path"]


def test_fp8_checkpoint_round_trips_bit_exactly_through_convert(tiny_deepseek, tmp_path):
    """16 x 16 blocks; the source quantises a set unlike FP8_WEIGHTS (no kv_a_proj_with_mqa), the
    export follows the source's set; MTP tensors (carried dequantised) are re-quantised too. At PP=2
    (stored and exported): the MTP layer, side data, is placed on no stage."""
    fp8 = tmp_path / "fp8"
    source = write_fp8_checkpoint(tiny_deepseek, fp8, (16, 16))
    for f in tiny_deepseek.iterdir():  # tokenizer + generation config
        if not f.name.endswith((".safetensors", ".json")) or f.name.startswith(("tokenizer", "generation", "special")):
            shutil.copy(f, fp8 / f.name)
    quantised = [n for n, t in source.items() if t.dtype == torch.float8_e4m3fn]
    assert any(n.startswith("model.layers.2.") for n in quantised)  # the MTP layer's block
    assert not any("kv_a_proj_with_mqa" in n for n in quantised)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    run = _run("hf-to-mcore", "--hf-dir", str(fp8), "--out-dir", str(mcore), "--tp", "1", "--pp", "2")
    assert run.returncode == 0, run.stderr[-4000:]
    run = _run("mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(back), "--export-fp8")
    assert run.returncode == 0, run.stderr[-4000:]
    written = read_hf_tensors(back)
    assert sorted(written) == sorted(source)
    diff = [
        n
        for n in source
        if written[n].dtype != source[n].dtype
        or written[n].shape != source[n].shape
        or not torch.equal(_bits(written[n]), _bits(source[n]))
    ]
    assert diff == []
    index = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(source)
    assert all(index[n + "_scale_inv"] == index[n] for n in quantised)
    config = json.loads((back / "config.json").read_text())
    assert config["quantization_config"] == json.loads((fp8 / "config.json").read_text())["quantization_config"]


def test_fresh_fp8_export_dequantises_within_fp8_rounding(tiny_deepseek, tmp_path):
    """A plain (float32) checkpoint written as FP8: DeepSeek-V3's tensor set, 128 x 128 blocks, the
    published quantization_config; transformers' dequantisation within the e4m3 bound."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from parallel.bridge.fp8 import FP8_WEIGHTS, write_fp8_export

    out = tmp_path / "out"
    shutil.copytree(tiny_deepseek, out)
    plain = read_hf_tensors(tiny_deepseek)
    stats = write_fp8_export(out)
    written = read_hf_tensors(out)
    quantised = sorted(n for n in plain if FP8_WEIGHTS.fullmatch(n))
    assert any("kv_a_proj_with_mqa" in n for n in quantised) and any("shared_experts.up_proj" in n for n in quantised)
    assert any(n.startswith("model.layers.2.self_attn") for n in quantised)
    assert not any(
        n.endswith(("gate.weight", "eh_proj.weight", "embed_tokens.weight", "head.weight")) for n in quantised
    )
    assert stats["quantized"] == len(quantised) and stats["blocks_kept"] == 0
    assert sorted(written) == sorted(list(plain) + [n + "_scale_inv" for n in quantised])
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(written)
    hf = Fp8Dequantize(None)
    worst, by_transformers = 0.0, 0
    for name in quantised:
        q, scale, w = written[name], written[name + "_scale_inv"], plain[name]
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert list(scale.shape) == [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]
        full = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        deq = q.float() * full  # the published formula; partial edge blocks (576 = 4.5 x 128 rows) too
        if w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:  # Fp8Dequantize takes whole blocks only
            assert torch.equal(hf._dequantize_one(q, scale, torch.float32), deq), name
            by_transformers += 1
        bound = torch.maximum(w.abs() * 2.0**-4, full * 2.0**-10) * (1 + 2.0**-20)
        assert bool(((deq - w).abs() <= bound).all()), name
        worst = max(worst, float(((deq - w).abs() / w.abs().clamp_min(1e-30)).max()))
    assert by_transformers >= 3 and worst > 0  # real rounding happened
    for name in plain:
        if name not in quantised:
            assert torch.equal(_bits(written[name]), _bits(plain[name])), name


def test_changed_blocks_get_fresh_scales_unchanged_keep_the_source():
    """requantize_fp8_blocks: blocks that dequantise back exactly keep the source's scale and FP8
    bytes; a changed block is quantised afresh (amax / 448); in bfloat16 too. (A changed block that
    the source's scale still represents exactly keeps it: it dequantises to the weights all the same.)"""
    from parallel.bridge.fp8 import FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks, requantize_fp8_blocks

    torch.manual_seed(0)
    block = (16, 16)
    q0, s0 = quantize_fp8_blocks(torch.randn(40, 48), block)
    s0 = s0 * 1.37  # a source quantiser unlike ours: max |q| < 448, so a fresh scale would differ
    for dtype in (torch.float32, torch.bfloat16):
        w = dequantize_fp8_blocks(q0, s0, block, dtype=dtype)
        q, s, kept = requantize_fp8_blocks(w, block, s0)
        assert kept == 9 and torch.equal(s, s0) and torch.equal(_bits(q), _bits(q0))
        w2 = w.clone()
        w2[17, 33] = 4 * w2[16:32, 32:48].abs().max()  # block (1, 2) outgrew its source scale's range
        q, s, kept = requantize_fp8_blocks(w2, block, s0)
        assert kept == 8 and torch.equal(s[1, 2], w2[16:32, 32:48].float().abs().max() / FP8_MAX)
        assert torch.equal(s.flatten()[torch.arange(9) != 5], s0.flatten()[torch.arange(9) != 5])
        assert torch.equal(_bits(q[:16]), _bits(q0[:16]))

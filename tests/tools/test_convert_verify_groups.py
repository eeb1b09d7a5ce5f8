"""The layer-group ``--verify``: HF's streamed reference, the Megatron side at parallel layouts,
and a wrong layer named.

* ``hf_stream_forward`` (weights read one part at a time, the output layer in blocks of rows) gives
  HF's own whole-model forward -- every layer's hidden states bit for bit, the logits up to the
  order of the output layer's sums; float32 and bf16, tied and MoE -- while at most
  one part (embedding, one layer group, head) holds weights; an FP8 block-quantised checkpoint is
  dequantised as it is read.
* The Megatron side (``verify_forwards`` with a group size: the converted bf16 model, its float32
  forward through the module-by-module twin, the output layer in blocks of 7 vocabulary rows)
  matches HF within the tolerances and gives the single-rank logits and hidden states at
  TP=2 (an MoE: sequence-parallel), PP=2 x VPP=2 and EP=2, and passes ``check_logits`` there.
* A checkpoint whose decoder layer 1 alone is wrong fails the check in float32 and bf16, and the
  message names layer group 2 of 2 (decoder layer 1); the correct one passes.
(The five families and the three wrong mappings through the tools: test_convert_verify.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed

LAYOUTS = {  # name: (family, ParallelConfig fields, ranks)
    "single": ("qwen3", {}, 1),
    "single_moe": ("qwen3_moe", {}, 1),
    "tp2_sp": ("qwen3_moe", dict(tensor_model_parallel_size=2), 2),  # an MoE at TP>1 is sequence-parallel
    "pp2_vpp2": ("qwen3", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2),
    "ep2": ("qwen3_moe", dict(expert_model_parallel_size=2), 2),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    work = tmp_path_factory.mktemp("groups")
    # Four layers (two per virtual stage at PP=2 x VPP=2), bf16 on disk as hub checkpoints are.
    return {
        f: build_tiny_hf_checkpoint(work / f, f, dtype=torch.bfloat16, num_hidden_layers=4)["path"]
        for f in ("qwen3", "qwen3_moe")
    }


def _ids(vocab: int = 300) -> tuple[torch.Tensor, list[int]]:
    from megatron_rl.convert.verify import verify_inputs

    return verify_inputs(None, vocab, 2)


# ---------------------------------------------------------------------------------------------
# HF's streamed reference.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_streamed_reference_is_hfs_own_forward_holding_one_part_at_a_time(ckpts, family, monkeypatch):
    from transformers import AutoModelForCausalLM

    from megatron_rl.convert import verify_hf
    from megatron_rl.convert.verify_hf import hf_stream_forward

    hf_dir, (ids, _) = ckpts[family], _ids()
    held = []  # parameters holding weights whenever a part has just been read
    load = verify_hf._Streamer.load

    def spy(self, modules):
        load(self, modules)
        held.append(sum(p.numel() for p in self.model.parameters() if not p.is_meta))

    monkeypatch.setattr(verify_hf._Streamer, "load", spy)
    monkeypatch.setattr(verify_hf, "HEAD_BLOCK_BYTES", 7 * 64 * 4)  # the output layer in blocks of rows
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        ).eval()
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        total = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        for per_group in (1, 3):
            held.clear()
            logits, hidden = hf_stream_forward(hf_dir, ids, torch.bfloat16, dtype, per_group)
            # blocks of vocabulary rows: the same dot products, summed in another order (in bf16: one ulp)
            torch.testing.assert_close(
                logits, out.logits.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 1.6e-2
            )
            ends = [0, 1, 2, 3] if per_group == 1 else [2, 3]
            assert sorted(hidden) == ends
            for end in ends[:-1]:
                assert torch.equal(hidden[end], out.hidden_states[end + 1].float()), (dtype, per_group, end)
            with torch.no_grad():  # HF's last hidden state is taken after the final norm
                normed = model.model.norm(hidden[3].to(dtype)).float()
            assert torch.equal(normed, out.hidden_states[-1].float())
            # embedding, the groups, head: never more than one part's weights at once
            embedding = model.model.embed_tokens.weight.numel()
            head = model.model.norm.weight.numel() + model.lm_head.weight.numel()  # tied or not: one matrix
            assert len(held) == 2 + len(ends) and held[0] == embedding and held[-1] == head
            assert max(held[1:-1]) == per_group * layer and total > 4 * layer + embedding


def test_streamed_reference_of_an_fp8_checkpoint_is_dequantised_as_read(tmp_path):
    """DeepSeek-V3's FP8 block format (which transformers cannot load on CPU without accelerate):
    the stream dequantises each weight as it reads it, and equals the stream of the dequantised
    checkpoint written out plainly (logits and hidden states), which is HF's forward of it."""
    from safetensors.torch import save_file

    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint
    from parallel.bridge.fp8 import dequantize_fp8_blocks
    from tests.megatron_rl.models.test_deepseek_fp8 import write_fp8_checkpoint
    from megatron_rl.convert.verify import hf_logits
    from megatron_rl.convert.verify_hf import hf_stream_forward

    src = build_tiny_hf_checkpoint(tmp_path / "hf", "deepseek_v3")["path"]
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    written = write_fp8_checkpoint(src, fp8, (16, 16))
    plain.mkdir()
    save_file(
        {
            n: dequantize_fp8_blocks(t, written[n + "_scale_inv"], (16, 16)) if t.dtype == torch.float8_e4m3fn else t
            for n, t in written.items()
            if not n.endswith("_scale_inv")
        },
        str(plain / "model.safetensors"),
    )
    config = json.loads((fp8 / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    assert sum(t.dtype == torch.float8_e4m3fn for t in written.values()) > 10
    ids, _ = _ids()
    logits, hidden = hf_stream_forward(fp8, ids, torch.float32, torch.float32, 1)
    plain_logits, plain_hidden = hf_stream_forward(plain, ids, torch.float32, torch.float32, 1)
    assert torch.equal(logits, plain_logits) and sorted(hidden) == [0, 1]
    assert all(torch.equal(hidden[k], plain_hidden[k]) for k in hidden)
    # and that is HF's whole-model forward of the plain checkpoint (its grouped-mm experts: same sums, reordered)
    torch.testing.assert_close(logits, hf_logits(plain, ids, torch.float32, torch.float32), rtol=0, atol=1e-5)


def test_streamed_reference_rounds_to_the_weight_dtype(tmp_path):
    """A float32 checkpoint converted to bf16: the reference's weights are the file's rounded to
    bf16, then upcast for the float32 forward (as the whole-model reference does), not the file's."""
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint
    from megatron_rl.convert.verify import hf_logits
    from megatron_rl.convert.verify_hf import hf_stream_forward

    hf_dir, (ids, _) = build_tiny_hf_checkpoint(tmp_path / "hf", "qwen3")["path"], _ids()
    rounded, _ = hf_stream_forward(hf_dir, ids, torch.bfloat16, torch.float32, 1)
    exact, _ = hf_stream_forward(hf_dir, ids, torch.float32, torch.float32, 1)
    torch.testing.assert_close(rounded, hf_logits(hf_dir, ids, torch.bfloat16, torch.float32), rtol=0, atol=1e-5)
    torch.testing.assert_close(exact, hf_logits(hf_dir, ids, torch.float32, torch.float32), rtol=0, atol=1e-5)
    assert (rounded - exact).abs().max() > 1e-3  # the rounding shows


def test_layer_groups():
    from megatron_rl.convert.verify_hf import layer_groups

    assert layer_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(5, 1) == [(i, i + 1) for i in range(5)]
    assert layer_groups(5, 0) == [(0, 5)] and layer_groups(3, 8) == [(0, 3)]
    with pytest.raises(ValueError, match=r"--verify-layers-per-group=-1 is not allowed"):
        layer_groups(5, -1)


# ---------------------------------------------------------------------------------------------
# The Megatron side at parallel layouts, and a wrong layer named.
# ---------------------------------------------------------------------------------------------
def _rank(rank: int, world: int, cases: list, per_group: int) -> dict:
    """Each case (layout name, HF dir, ParallelConfig fields, reference HF dirs): the converted
    bf16 model's grouped forwards (float32 and bf16) and, on rank 0, check_logits against each
    reference dir (None when it passes, else its error)."""
    import io
    from contextlib import redirect_stdout

    from megatron_rl.models.families import get_family, load_hf_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from megatron_rl.convert.support import ToolError
    from megatron_rl.convert.streamed_model import build_empty_model
    from megatron_rl.convert import verify_groups
    from megatron_rl.convert.verify import check_logits, verify_forwards, verify_inputs, VerifySettings

    verify_groups.OUTPUT_BLOCK_BYTES = 7 * 64 * 4  # the float32 output layer in uneven blocks of 7 rows
    out = {}
    for name, hf_dir, layout, references in cases:
        hf_config = load_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
        family = get_family(hf_config)
        model_cfg = family.model_config(hf_config, make_vocab_size_divisible_by=128, params_dtype="bfloat16")
        pc = ParallelConfig(**layout)
        mesh = init_mesh(pc)
        try:
            chunks = build_empty_model(model_cfg, pc)
            load_hf_checkpoint(chunks, family.weight_map(model_cfg), hf_dir, mesh=mesh)
            ids, lengths = verify_inputs(None, model_cfg.vocab_size, pc.tensor_model_parallel_size)
            results = verify_forwards(
                chunks, model_cfg, pc, mesh, ids, VerifySettings(["float32", "bfloat16"], per_group)
            )
        finally:
            destroy_mesh(mesh)
        if rank == 0:
            checks = {}
            for ref in references:
                text = io.StringIO()
                try:
                    with redirect_stdout(text):
                        check_logits(results, ref, ids, torch.bfloat16, lengths, None)
                    checks[ref] = (None, text.getvalue())
                except ToolError as exc:
                    checks[ref] = (str(exc), text.getvalue())
            out[name] = dict(logits=dict(results), hidden=results.hidden, lengths=lengths, checks=checks)
    return out


@pytest.fixture(scope="module")
def single(ckpts, tmp_path_factory):
    """Single-rank runs, checked against the right checkpoints and one whose layer 1 is wrong."""
    from safetensors.torch import load_file, save_file

    wrong = tmp_path_factory.mktemp("wrong") / "qwen3"
    shutil.copytree(ckpts["qwen3"], wrong)
    for f in wrong.glob("*.safetensors"):  # decoder layer 1's query heads 0 and 1 swapped, nothing else
        tensors = load_file(f)
        name = "model.layers.1.self_attn.q_proj.weight"
        if name in tensors:
            q, d = tensors[name].clone(), json.loads((wrong / "config.json").read_text())["head_dim"]
            q[:d], q[d : 2 * d] = tensors[name][d : 2 * d], tensors[name][:d]
            save_file({**tensors, name: q}, str(f), metadata={"format": "pt"})
    cases = [
        ("single", str(ckpts["qwen3"]), {}, [str(ckpts["qwen3"]), str(wrong)]),
        ("single_moe", str(ckpts["qwen3_moe"]), {}, [str(ckpts["qwen3_moe"])]),
    ]
    return run_distributed(_rank, 1, cases, 1, timeout_s=300)[0], str(wrong)


def test_a_wrong_layer_is_named_in_both_dtypes(single, ckpts):
    runs, wrong = single
    error, printed = runs["single"]["checks"][wrong]
    assert error is not None and error.count("(first diverging: layer group 2 of 4 (decoder layer 1))") == 2, error
    assert "max |logit diff|" in error and "of the float32 forward" in error and "of the bfloat16 forward" in error
    for dtype in ("float32", "bfloat16"):
        assert f"verify ({dtype} forward) hidden states: 4 layer groups of 1 layer(s)" in printed
    assert printed.count("first diverging: layer group 2 of 4 (decoder layer 1), ") == 2
    for name, family in (("single", "qwen3"), ("single_moe", "qwen3_moe")):
        error, printed = runs[name]["checks"][str(ckpts[family])]
        assert error is None, (error, printed)
        assert printed.count(": OK") == 2 and printed.count("every group agrees") == 2


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2_vpp2", "ep2"])
def test_parallel_layouts_give_the_single_rank_result(single, ckpts, layout, parallel_runs):
    got = parallel_runs[layout]
    base = single[0]["single_moe" if LAYOUTS[layout][0] == "qwen3_moe" else "single"]
    error, printed = got["checks"][str(ckpts[LAYOUTS[layout][0]])]
    assert error is None, (error, printed)
    assert printed.count("every group agrees") == 2
    lengths = base["lengths"]
    for i, n in enumerate(lengths):  # float32 forwards: the same values up to reduction order
        torch.testing.assert_close(got["logits"]["float32"][i, :n], base["logits"]["float32"][i, :n], rtol=0, atol=2e-5)
        assert sorted(got["hidden"]["float32"]) == sorted(base["hidden"]["float32"]) == [0, 1, 2, 3]
        for end, h in base["hidden"]["float32"].items():
            torch.testing.assert_close(got["hidden"]["float32"][end][i, :n], h[i, :n], rtol=0, atol=2e-5)
        assert sorted(got["hidden"]["bfloat16"]) == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def parallel_runs(ckpts):
    """TP=2 (sequence-parallel), PP=2 x VPP=2, EP=2: one pair of spawned ranks for all three."""
    cases = [
        (name, str(ckpts[LAYOUTS[name][0]]), LAYOUTS[name][1], [str(ckpts[LAYOUTS[name][0]])])
        for name in ("tp2_sp", "pp2_vpp2", "ep2")
    ]
    return run_distributed(_rank, 2, cases, 1, timeout_s=400)[0]

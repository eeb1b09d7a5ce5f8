"""The hf-to-mcore output is what Megatron-LM's ``--load DIR --ckpt-format torch_dist`` reads.

A tiny Qwen3 converts at TP=2 and at TP=1 x PP=2 in the default (Megatron-LM) layout. Each rank
then does what Megatron-LM does, with Megatron-Core only: builds a plain ``GPTModel`` the way
``pretrain_gpt.py``'s model provider does (``gpt_builder``: ``core_transformer_config_from_args``,
the local layer spec, ``GPTModel(...)``) from nothing but ``megatron_args.json``; finds the
checkpoint through ``latest_checkpointed_iteration.txt`` (``get_checkpoint_name``); reads the
common state (``checkpoint_version``) and loads the sharded state with
``megatron.core.dist_checkpointing.load``. Its logits equal megatron_rl's own load of the same
checkpoint and HF's (transformers). (mcore-to-hf reading this layout: test_convert_verify.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TO_MCORE = [sys.executable, str(ROOT / "tools" / "convert_hf_to_mcore.py")]
LAYOUTS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}


def _cpu_causal_mask() -> None:
    """Megatron's local attention builds its default causal mask with ``device="cuda"``; on CPU build
    it on the CPU (parallel.cpu_compat replaces that attention for megatron_rl's own models)."""
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _megatron_lm_rank(rank: int, world: int, load_dir: str, ids: torch.Tensor) -> dict:
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.checkpoint import load_model
    from parallel.config import ParallelConfig
    from parallel.cpu_compat import cpu_transformer_config_overrides
    from parallel.mesh import destroy_mesh, init_mesh
    from megatron_rl.convert.verify import megatron_logits

    _cpu_causal_mask()
    args = json.loads((Path(load_dir) / "megatron_args.json").read_text())["args"]
    pc = ParallelConfig(
        tensor_model_parallel_size=args["tensor_model_parallel_size"],
        pipeline_model_parallel_size=args["pipeline_model_parallel_size"],
    )
    mesh = init_mesh(pc)  # mpu.initialize_model_parallel (+ the CPU redirects)
    try:
        # megatron.training.checkpointing: read_metadata + get_checkpoint_name.
        tracker = (Path(load_dir) / "latest_checkpointed_iteration.txt").read_text().strip()
        name = str(Path(load_dir) / ("release" if tracker == "release" else f"iter_{int(tracker):07d}"))
        assert dist_checkpointing.check_is_distributed_checkpoint(name)
        common = dist_checkpointing.load_common_state_dict(name)
        # core_transformer_config_from_args, for the flags megatron_args.json sets.
        config = TransformerConfig(
            num_layers=args["num_layers"],
            hidden_size=args["hidden_size"],
            ffn_hidden_size=args["ffn_hidden_size"],
            num_attention_heads=args["num_attention_heads"],
            num_query_groups=args["num_query_groups"] if args["group_query_attention"] else None,
            kv_channels=args["kv_channels"],
            normalization=args["normalization"],
            layernorm_epsilon=args["norm_epsilon"],
            qk_layernorm=args["qk_layernorm"],
            add_qkv_bias=args["add_qkv_bias"],
            add_bias_linear=not args["disable_bias_linear"],
            gated_linear_unit=args["swiglu"],
            activation_func=F.silu if args["swiglu"] else F.gelu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.bfloat16 if args["bf16"] else torch.float32,
            bf16=args["bf16"],
            pipeline_dtype=torch.bfloat16 if args["bf16"] else torch.float32,
            tensor_model_parallel_size=args["tensor_model_parallel_size"],
            pipeline_model_parallel_size=args["pipeline_model_parallel_size"],
            **{"bias_activation_fusion": False, **cpu_transformer_config_overrides()},
        )
        spec = get_gpt_layer_local_spec(None, False, args["qk_layernorm"], normalization=args["normalization"])
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args["padded_vocab_size"],
            max_sequence_length=args["max_position_embeddings"],
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
            position_embedding_type=args["position_embedding_type"],
            rotary_percent=args["rotary_percent"],
            rotary_base=args["rotary_base"],
            rope_scaling=args["use_rope_scaling"],
        )
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, name)
        model.load_state_dict(state["model"], strict=True)
        theirs = megatron_logits([model], mesh, ids, args["vocab_size"])

        meta = json.loads((Path(load_dir) / "megatron_rl_conversion.json").read_text())
        family = get_family(meta["architecture"])
        model_cfg = family.model_config(meta["hf_config"], make_vocab_size_divisible_by=128, params_dtype="float32")
        ours = build_model(model_cfg, build_transformer_config(model_cfg, pc))
        load_model(ours, load_dir)
        mine = megatron_logits(ours, mesh, ids, model_cfg.vocab_size)
    finally:
        destroy_mesh(mesh)
    return {
        "common": {k: v for k, v in common.items() if k in ("checkpoint_version", "iteration")},
        "theirs": theirs,
        "ours": mine,
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    work = tmp_path_factory.mktemp("mlm")
    hf = build_tiny_hf_checkpoint(work / "hf", "qwen3")["path"]
    procs = {
        name: subprocess.Popen(
            [*TO_MCORE, "--hf-dir", str(hf), "--out-dir", str(work / name), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for name, flags in LAYOUTS.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
    return work, hf


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_lm_loads_the_conversion(converted, layout):
    from transformers import AutoModelForCausalLM

    from parallel.testing import run_distributed

    work, hf = converted
    out = work / layout
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    for name in ("metadata.json", "common.pt", ".metadata", "megatron_rl_complete.json"):
        assert (out / "release" / name).is_file(), name
    assert json.loads((out / "release" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    doc = json.loads((out / "megatron_args.json").read_text())
    tp, pp = (2, 1) if layout == "tp2" else (1, 2)
    assert (doc["args"]["tensor_model_parallel_size"], doc["args"]["pipeline_model_parallel_size"]) == (tp, pp)
    assert doc["args"]["padded_vocab_size"] == (512 if tp == 2 else 384) and doc["args"]["vocab_size"] == 300
    cmd = doc["command_line"]
    assert cmd.startswith("pretrain_gpt.py --num-layers 2 --hidden-size 64 --ffn-hidden-size 96 ")
    for flag in (
        "--group-query-attention --num-query-groups 2",
        "--kv-channels 32",
        "--qk-layernorm",
        "--normalization RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        f"--tensor-model-parallel-size {tp}",
        f"--pipeline-model-parallel-size {pp}",
        "--ckpt-format torch_dist",
        f"--load {out}",
        "--tokenizer-type HuggingFaceTokenizer",
    ):
        assert flag in cmd, flag

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 12), generator=gen)
    result = run_distributed(_megatron_lm_rank, 2, str(out), ids, timeout_s=300)[0]
    assert result["common"] == {"checkpoint_version": 3.0, "iteration": 0}
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        reference = hf_model(input_ids=ids).logits.float()
    assert result["theirs"].shape == reference.shape == (2, 12, 300)
    assert float((result["theirs"] - result["ours"]).abs().max()) < 1e-5
    assert float((result["theirs"] - reference).abs().max()) < 1e-4

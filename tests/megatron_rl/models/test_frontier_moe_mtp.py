"""Multi-token-prediction layers of DeepSeek-V3 / GLM-4.5 checkpoints (one MTP layer, as hub
checkpoints hold it: ``model.layers.{num_hidden_layers}``): the model does not build them, yet
``megatron-rl convert`` HF -> Megatron -> HF gives every MTP tensor back bit for bit, loading warns
by name that they are not trained, the trainer's HF export helper reads them from the source, and
incomplete or mis-shaped MTP layers are named before anything is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.models.test_families import read_hf_tensors

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "megatron_rl.cli", "convert"]
FAMILIES = ("deepseek_v3", "glm4_moe")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def mtp_ckpts(tmp_path_factory) -> dict[str, Path]:
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("mtp")
    return {f: build_tiny_hf_checkpoint(root / f, f, mtp_layers=1)["path"] for f in FAMILIES}


def test_tiny_builder_writes_the_hub_mtp_layout(mtp_ckpts):
    config = json.loads((mtp_ckpts["deepseek_v3"] / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    names = set(read_hf_tensors(mtp_ckpts["deepseek_v3"]))
    own = {
        f"model.layers.2.{s}"
        for s in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
        )
    }
    assert own <= names and "model.layers.2.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight" in names and not any(".layers.3." in n for n in names)


def test_convert_round_trip_carries_glm_mtp_layers_bit_exactly(mtp_ckpts, tmp_path):
    """GLM-4.5 at TP=1 here; DeepSeek-V3's MTP layer goes through the TP=2 --verify round trip of
    test_frontier_moe.py (test_megatron_rl_convert_round_trip_of_deepseek_v3_is_bit_exact)."""
    hf = mtp_ckpts["glm4_moe"]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    to_mcore = _run("hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(mcore), "--tp", "1")
    assert to_mcore.returncode == 0, to_mcore.stderr[-4000:]
    assert "num_nextn_predict_layers=1" in to_mcore.stderr and "are not trained" in to_mcore.stderr
    meta = json.loads((mcore / "megatron_rl_conversion.json").read_text())
    source = read_hf_tensors(hf)
    mtp_names = sorted(n for n in source if n.startswith("model.layers.2."))
    assert meta["mtp_file"] == "mtp/mtp.safetensors" and meta["mtp_tensors"] == mtp_names and len(mtp_names) > 20
    back_run = _run("mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(back))
    assert back_run.returncode == 0, back_run.stderr[-4000:]
    assert f" tensors + {len(mtp_names)} MTP tensors carried, " in back_run.stdout
    written = read_hf_tensors(back)
    assert sorted(written) == sorted(source)
    assert [n for n in source if written[n].dtype != source[n].dtype or not torch.equal(source[n], written[n])] == []
    index = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[n] for n in mtp_names} == {"model-mtp.safetensors"} and set(index) == set(source)
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


def _damage(src: Path, dst: Path, drop: str = "", reshape: str = "") -> Path:
    """A copy of ``src`` whose MTP file lacks ``drop`` or holds ``reshape`` with one row too few."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    where = data["weight_map"][drop or reshape]
    tensors = load_file(str(dst / where))
    if drop:
        del tensors[drop]
        del data["weight_map"][drop]
    else:
        tensors[reshape] = tensors[reshape][:-1].clone()
    save_file(tensors, str(dst / where))
    index.write_text(json.dumps(data))
    return dst


def test_bad_mtp_layers_are_named_before_anything_is_written(mtp_ckpts, tmp_path):
    from megatron_rl.models.families import get_family
    from parallel.bridge import HFCheckpointReader

    src = mtp_ckpts["deepseek_v3"]
    missing = _damage(src, tmp_path / "missing", drop="model.layers.2.mlp.experts.3.up_proj.weight")
    shaped = _damage(src, tmp_path / "shaped", reshape="model.layers.2.eh_proj.weight")
    model_cfg = get_family(src).model_config(src)
    mtp = get_family(src).weight_map(model_cfg).mtp
    with HFCheckpointReader(missing) as r:
        assert mtp.check(r, 1) == [
            "MTP tensor 'model.layers.2.mlp.experts.3.up_proj.weight' is missing (MTP layer 0 "
            "of num_nextn_predict_layers=1 needs it, shape [32, 64])"
        ]
    with HFCheckpointReader(shaped) as r:
        assert mtp.check(r, 1) == [
            "MTP tensor 'model.layers.2.eh_proj.weight' has shape [63, 128] but [64, 128] is expected"
        ]
    with HFCheckpointReader(src) as r:
        assert mtp.check(r, 1) == [] and mtp.check(r, 0) == [] and len(mtp.names(r, 1)) > 20
    out = tmp_path / "out"
    proc = _run("hf-to-mcore", "--hf-dir", str(shaped), "--out-dir", str(out), "--tp", "1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        "bad multi-token-prediction layers (num_nextn_predict_layers=1): MTP tensor "
        "'model.layers.2.eh_proj.weight' has shape [63, 128]" in proc.stderr
    ), proc.stderr[-3000:]
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _load_warnings(rank, world_size, hf_dir):
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir)
    pc = ParallelConfig()
    mesh = init_mesh(pc, seed=1)
    chunks = build_model(model_cfg, build_transformer_config(model_cfg, pc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_hf_checkpoint(chunks, family.weight_map(model_cfg), hf_dir, mesh=mesh)
    return [str(w.message) for w in caught if "multi-token" in str(w.message)]


def test_trainer_load_warns_mtp_layers_are_not_trained_and_export_reads_them(mtp_ckpts, tmp_path):
    from parallel.bridge.mtp import source_mtp_tensors

    hf = mtp_ckpts["glm4_moe"]
    texts = run_distributed(_load_warnings, 1, str(hf), timeout_s=200)[0]
    assert len(texts) == 1 and "multi-token-prediction layer(s) (num_nextn_predict_layers=1, " in texts[0]
    assert "are not trained" in texts[0]
    source = read_hf_tensors(hf)
    carried = source_mtp_tensors(hf)  # what trainer/hf_export.py adds to final_hf
    assert sorted(carried) == sorted(n for n in source if n.startswith("model.layers.2."))
    assert all(torch.equal(carried[n], source[n]) for n in carried)
    (tmp_path / "config.json").write_text((hf / "config.json").read_text())  # declared, but no weights here
    assert source_mtp_tensors(tmp_path) == {}


def test_mtp_training_switch_stays_inert_with_its_reason():
    from megatron_rl.config import RunConfig, compose
    from megatron_rl.config.compat import InertKeyWarning
    from megatron_rl.config.verl_keys import VERL_CONFIG_DIR

    verl = str(VERL_CONFIG_DIR / "ppo_megatron_trainer.yaml")
    overrides = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.model.mtp.enable=true",
        "actor_rollout_ref.model.mtp.enable_train=true",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunConfig.from_dict(compose(verl, overrides))
    texts = [str(w.message) for w in caught if issubclass(w.category, InertKeyWarning)]
    for key in ("actor_rollout_ref.model.mtp.enable", "actor_rollout_ref.model.mtp.enable_train"):
        hit = [t for t in texts if t.startswith(key + "=")]
        assert hit and "multi-token prediction" in hit[0] and "not implemented" in hit[0], texts

"""The auxiliary Megatron roles through their worker groups: the reward model (scalar head) and the
distillation teacher (the actor role's distillation loss is tested in
``tests/megatron_rl/roles/test_actor_distillation.py``).

* Reward model: a tiny HF ``Qwen3ForSequenceClassification`` / ``LlamaForSequenceClassification``
  (random weights, built from a config, no hub) is loaded by the ``reward`` worker group at TP=1 and
  TP=2; ``rm_scores`` must equal HF's ``model(input_ids, attention_mask).logits``. The batch has verl's
  layout (left-padded prompt | right-padded response) with every pad set to ``pad_token_id`` and no
  real token equal to it, so HF's "last non-pad token" is our "last attention_mask token"; HF runs
  with its default positions ``arange(seq)``, which only shift a left-padded row's RoPE positions by
  a constant (attention depends on position differences only).
* Teacher: the ``teacher`` group's log-probs equal HF's causal-LM log-softmax at the same temperature.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ActorConfig, RewardModelConfig
from tests.megatron_rl.roles.test_actor_distillation import BATCH, PAD, RESPONSE, VOCAB, make_batch

ray = pytest.importorskip("ray")

SCORE_TOL = 1e-5


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """O(1) weights (the HF init's std 0.02 gives near-zero outputs and a meaningless tolerance)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)


def _hf_model(path, family: str, head: str, seed: int):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megatron_rl.models.families import load_hf_config
    from megatron_rl.models.tiny_checkpoints import TINY_HF_CONFIGS

    base = TINY_HF_CONFIGS[family]["architectures"][0]
    arch = base.replace("ForCausalLM", "ForSequenceClassification") if head == "score" else base
    config = load_hf_config(
        dict(
            TINY_HF_CONFIGS[family],
            architectures=[arch],
            vocab_size=VOCAB,
            pad_token_id=PAD,
            bos_token_id=None,
            eos_token_id=1,
            num_labels=1,
        )
    )
    auto = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    _redraw(model, seed)
    model.save_pretrained(str(path))
    return model


def _group(role, hf_dir, tp, role_config):
    from megatron_rl.config import MegatronConfig
    from megatron_rl.workers.group import MegatronWorkerGroup
    from megatron_rl.workers.spec import WorkerSpec

    spec = WorkerSpec(
        role, MegatronConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1), role_config, hf_dir=str(hf_dir)
    )
    return MegatronWorkerGroup(spec, tp, num_cpus_per_worker=1.0 / tp, name=f"{role}_tp{tp}")


# ----------------------------------------------------------------------------- reward model
@pytest.mark.parametrize("family,layouts", [("qwen3", (1, 2)), ("llama", (2,))])
def test_reward_model_scores_equal_hf_sequence_classification(ray_cluster, tmp_path, family, layouts):
    hf = _hf_model(tmp_path / "rm", family, "score", seed=3)
    batch = make_batch(1)
    with torch.no_grad():
        expected = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    assert expected.abs().max() > 0.1  # O(1) scores, so the tolerance is meaningful
    for tp in layouts:
        group = _group("reward", tmp_path / "rm", tp, RewardModelConfig(micro_batch_size_per_gpu=3))
        try:
            scores = group.compute_rm_score(batch)["rm_scores"]
            scores_mbs1 = group.compute_rm_score(batch, micro_batch_size=1)["rm_scores"]
        finally:
            group.shutdown()
        assert scores.shape == (BATCH,)
        diff = max(float((scores - expected).abs().max()), float((scores_mbs1 - expected).abs().max()))
        assert diff < SCORE_TOL, (family, tp, diff)


def test_reward_role_rejects_a_causal_lm_checkpoint(tmp_path):
    """Checked before the rank joins any process group (so here without Ray)."""
    from megatron_rl.config import MegatronConfig
    from megatron_rl.workers.megatron_worker import MegatronWorker
    from megatron_rl.workers.spec import WorkerSpec

    _hf_model(tmp_path / "lm", "qwen3", "lm", seed=0)
    _hf_model(tmp_path / "rm", "qwen3", "score", seed=0)
    worker = MegatronWorker(0, 1)
    with pytest.raises(
        ValueError,
        match=r"reward: .* is not a reward model; it needs an HF "
        r"\*ForSequenceClassification checkpoint with num_labels=1",
    ):
        worker.init_engine("127.0.0.1", 0, WorkerSpec("reward", MegatronConfig(), hf_dir=str(tmp_path / "lm")))
    with pytest.raises(ValueError, match=r"teacher: .* is a \*ForSequenceClassification checkpoint \(no lm_head\)"):
        worker.init_engine("127.0.0.1", 0, WorkerSpec("teacher", MegatronConfig(), hf_dir=str(tmp_path / "rm")))


# ----------------------------------------------------------------------------- teacher
def test_teacher_group_log_probs_equal_hf(ray_cluster, tmp_path):
    hf = _hf_model(tmp_path / "teacher", "qwen3", "lm", seed=5)
    batch = make_batch(2)
    temperature = 0.7
    group = _group("teacher", tmp_path / "teacher", 1, ActorConfig(ppo_micro_batch_size_per_gpu=4))
    try:
        out = group.compute_log_prob(batch, temperature=temperature)["log_probs"]
    finally:
        group.shutdown()
    expected = torch.zeros(BATCH, RESPONSE)
    with torch.no_grad():
        for i in range(BATCH):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
            n = int(batch["response_mask"][i].sum())
            if n:
                logp = (hf(input_ids=ids).logits[0].float() / temperature).log_softmax(-1)[-n - 1 : -1]
                expected[i, :n] = logp.gather(-1, ids[0, -n:, None]).squeeze(-1)
    mask = batch["response_mask"].bool()
    assert out.shape == (BATCH, RESPONSE)
    assert float((out[mask] - expected[mask]).abs().max()) < 2e-5

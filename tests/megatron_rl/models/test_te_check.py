"""TransformerEngine asked for but missing fails by name with TE's import error; context parallelism
at float32 is refused before a model is built (TE's CP attention needs fp16 / bf16)."""

from __future__ import annotations

import pytest

from megatron_rl.config.model import ModelConfig
from megatron_rl.engine.engine import check_context_parallel
from megatron_rl.models.gpt import get_layer_spec, te_available, te_import_error

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=32)
NO_TE = "ModuleNotFoundError: No module named 'transformer_engine'"


def test_te_import_error_is_kept_not_swallowed():
    assert te_import_error() == NO_TE and not te_available()  # this CPU machine has no TE


def test_te_attention_without_te_fails_with_the_import_error():
    with pytest.raises(
        RuntimeError,
        match=r"^model.attention_backend='te' needs TransformerEngine, which does not "
        rf"import in this process \({NO_TE}\)",
    ):
        get_layer_spec(ModelConfig(**TINY, attention_backend="te"))
    get_layer_spec(ModelConfig(**TINY, attention_backend="auto"))  # auto without TE: the local spec, no error


def test_context_parallel_refuses_float32_then_needs_te():
    with pytest.raises(ValueError, match=r"^megatron.context_parallel_size=2 needs bfloat16 or float16 parameters"):
        check_context_parallel(ModelConfig(**TINY), 2)
    with pytest.raises(RuntimeError, match=rf"^megatron.context_parallel_size=2 needs TransformerEngine.*{NO_TE}"):
        check_context_parallel(ModelConfig(**TINY, params_dtype="bfloat16"), 2)
    check_context_parallel(ModelConfig(**TINY), 1)  # no CP: nothing asked

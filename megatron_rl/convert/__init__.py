"""Checkpoint conversion: Hugging Face <-> Megatron-Core distributed checkpoint (``megatron-rl convert``).

``hf_to_mcore`` and ``mcore_to_hf`` are the two commands; ``support`` (constants, errors, files),
``launch`` (ranks and layout flags), ``output`` (atomic output directory, progress, peak memory),
``verify`` / ``verify_hf`` / ``verify_groups`` (``--verify``), ``streamed_model`` (meta-device models
filled tensor by tensor), ``fault`` (test-only wrong mappings), ``megatron_lm`` (Megatron-LM's
``--load`` layout) and ``preload`` (what the ranks' fork server imports) serve them. Nothing here
is imported by the package's ``__init__``: the driver starts without torch.
"""

"""Imported once by ``parallel.testing``'s rank fork server: what most rank functions import.

Every gloo rank of ``run_distributed`` is forked from that server, so it starts with torch and
Megatron loaded (their imports take seconds per process) and shares those pages instead of
holding a copy of its own.
"""

import atexit
import gc
import warnings

from parallel.testing import exit_server_at_once

# Megatron's import-time notices (no TransformerEngine / Apex on CPU), once here instead of per rank.
warnings.filterwarnings("ignore", module=r"megatron(\.|$)")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

try:
    import megatron.core.models.gpt  # noqa: E402,F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401
    import megatron.core.optimizer  # noqa: E402,F401
    import megatron.core.pipeline_parallel  # noqa: E402,F401
    import megatron.core.dist_checkpointing  # noqa: E402,F401
except ImportError:  # a rank that needs Megatron imports it itself, and says why it cannot
    pass

atexit.register(exit_server_at_once)

# Objects imported so far move to the permanent generation: the ranks' collections never walk
# (and so never write to, and copy) the pages they inherit from the server.
gc.freeze()

"""Imported once by the converters' fork server (``tools.convert_launch.prestart``): what every rank needs.

The CPU ranks are forked from that server, so they start with these modules loaded (Megatron's
import alone takes seconds and hundreds of MiB) and share those pages instead of each holding a copy.
"""

from tools.convert_launch import quiet_warnings

quiet_warnings()  # before Megatron's import-time warnings

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401  (build_model's specs: 0.3 s per rank otherwise)
import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: E402,F401  (the writer)
import torch.distributed.checkpoint  # noqa: E402,F401

import megatron_rl.models.families  # noqa: E402,F401
import megatron_rl.models.gpt  # noqa: E402,F401
import parallel.bridge  # noqa: E402,F401
import parallel.checkpoint  # noqa: E402,F401
import parallel.mesh  # noqa: E402,F401
import tools.convert_hf_to_mcore  # noqa: E402,F401
import tools.convert_mcore_to_hf  # noqa: E402,F401
import tools.convert_stream  # noqa: E402,F401

import atexit  # noqa: E402
import gc  # noqa: E402

# Every object imported so far moves to the permanent generation: the ranks' collections never walk
# (and so never write to, and copy) the pages of the modules they inherit from this server. The
# server itself unfreezes them when it exits, so its own teardown collects them as before (frozen,
# they would outlive it: nanobind's leak check then prints a report on the user's stderr).
gc.freeze()
atexit.register(gc.unfreeze)

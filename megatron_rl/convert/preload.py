"""Imported once by the converters' fork server (``megatron_rl.convert.launch.prestart``): what every rank needs.

The CPU ranks are forked from that server, so they start with these modules loaded (Megatron's
import alone takes seconds and hundreds of MiB) and share those pages instead of each holding a copy.
"""

import torch  # noqa: F401

from megatron_rl.convert.launch import quiet_warnings

quiet_warnings()  # before Megatron's import-time warnings

# `import megatron_rl` installed parallel.lazy_jit: Megatron's fused kernels (which the converters never
# call; a `--verify` forward that does compiles them then) are not compiled at import, which would
# import dynamo and inductor (~1.9 s of the server's ~5 s).
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
import megatron_rl.convert.hf_to_mcore  # noqa: E402,F401
import megatron_rl.convert.mcore_to_hf  # noqa: E402,F401
import megatron_rl.convert.streamed_model  # noqa: E402,F401

import atexit  # noqa: E402
import gc  # noqa: E402

from parallel.testing import exit_server_at_once  # noqa: E402


# Every object imported so far moves to the permanent generation: the ranks' collections never walk
# (and so never write to, and copy) the pages of the modules they inherit from this server. The
# server ends with os._exit (exit_server_at_once, its only atexit handler), so no teardown walks them
# either (nanobind's leak check, which would report the frozen objects, never runs).
gc.freeze()
atexit.register(exit_server_at_once)

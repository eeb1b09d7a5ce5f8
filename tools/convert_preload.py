"""Imported once by the converters' fork server (``tools.convert_launch.prestart``): what every rank needs.

The CPU ranks are forked from that server, so they start with these modules loaded (Megatron's
import alone takes seconds and hundreds of MiB) and share those pages instead of each holding a copy.
"""

from tools.convert_launch import quiet_warnings

quiet_warnings()  # before Megatron's import-time warnings

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401

import megatron_rl.models.families  # noqa: E402,F401
import megatron_rl.models.gpt  # noqa: E402,F401
import parallel.bridge  # noqa: E402,F401
import parallel.checkpoint  # noqa: E402,F401
import parallel.mesh  # noqa: E402,F401
import tools.convert_hf_to_mcore  # noqa: E402,F401
import tools.convert_mcore_to_hf  # noqa: E402,F401
import tools.convert_stream  # noqa: E402,F401

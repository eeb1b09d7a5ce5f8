"""``python tools/convert_hf_to_mcore.py ...`` (and ``torchrun ... tools/convert_hf_to_mcore.py``) from a checkout.

The converter is ``megatron_rl.convert.hf_to_mcore`` (installed with the package: ``megatron-rl convert``,
``python -m megatron_rl.convert.hf_to_mcore``); this file only runs it.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_rl.convert.hf_to_mcore import main  # noqa: E402
from megatron_rl.convert.support import exit_now  # noqa: E402

if __name__ == "__main__":
    exit_now(main())

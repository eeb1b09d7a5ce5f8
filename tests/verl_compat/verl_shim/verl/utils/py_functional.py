"""``verl.utils.py_functional``: verl-only helpers (see verl/_verl_only.py)."""

from verl._verl_only import verl_only

append_to_dict = verl_only("append_to_dict")

"""Part of the verl import shim (see verl/__init__.py)."""

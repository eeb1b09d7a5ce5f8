"""A same-name import shim: verl 0.9.1's module paths that its algorithm-layer unit tests import, each
re-exporting the project's objects (``megatron_rl.algos``, ``megatron_rl.config``, ``megatron_rl.data``),
so verl's own tests run against this project with only ``sys.path`` changed. Test-only: it is on the
path only inside ``tests/megatron_rl/algos/test_verl_unit_tests.py``'s subprocess."""

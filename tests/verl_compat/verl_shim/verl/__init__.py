"""A same-name import shim: the verl 0.9.1 module paths that verl's algorithm-layer unit tests import,
each mapping verl's names to this project's implementation (``megatron_rl.algos``, ``megatron_rl.config``,
``megatron_rl.data``, ``megatron_rl.trainer.metrics``). Signatures are adapted where verl's differ
(a ``DataProto`` where the project takes tensors, verl's keyword names); no algorithm is re-implemented
here. Test-only: it is on ``sys.path`` only in the subprocess of
``tests/verl_compat/test_verl_tests_through_shim.py``; the project never imports verl.
"""

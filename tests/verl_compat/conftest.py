"""The vendored verl tests and the shim are not part of the project's own collection: they run only in the
subprocess of ``test_verl_tests_through_shim.py``, with the shim on ``sys.path``."""

collect_ignore = ["verl_tests", "verl_shim"]

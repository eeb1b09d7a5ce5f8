"""Command-line tools over the library (conversion, benchmarks); importable so spawned ranks can find their functions."""

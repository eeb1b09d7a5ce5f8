"""The main job, ``megatron-rl train``: model preparation, the run, the report."""

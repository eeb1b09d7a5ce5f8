"""A user callback given to the trainer by dotted path (``trainer.callbacks``) in the trainer tests: it
appends one JSON line per hook call to the file ``$MEGATRON_RL_HOOK_LOG`` names (the test reads it back,
whichever module object the trainer imported)."""

from __future__ import annotations

import json
import os

from megatron_rl.trainer.callbacks import TrainerCallback


class HookRecorder(TrainerCallback):
    def _record(self, hook: str, **fields) -> None:
        with open(os.environ["MEGATRON_RL_HOOK_LOG"], "a") as f:
            f.write(json.dumps({"hook": hook, **fields}) + "\n")

    def on_fit_start(self, trainer, step):
        self._record("on_fit_start", step=step, workers=trainer.actor is not None)

    def on_validation_end(self, trainer, step, metrics):
        self._record("on_validation_end", step=step, keys=sorted(metrics))

    def on_checkpoint(self, trainer, step, path):
        self._record("on_checkpoint", step=step, path=str(path), exists=path.is_dir())

    def on_step_end(self, trainer, step, metrics):
        self._record("on_step_end", step=step, global_step=metrics.get("training/global_step"))

    def on_fit_end(self, trainer, history):
        self._record("on_fit_end", steps=[row.get("training/global_step") for row in history])

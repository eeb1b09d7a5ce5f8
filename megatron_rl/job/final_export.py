"""``FinalExport``: the main job's last side concern, the trained actor as an HF checkpoint, as a callback.

It runs at ``on_fit_end`` (after ``fit`` has restored every model), before the user's callbacks
(``order`` -10), so a user's ``on_fit_end`` finds it in ``final_hf``'s staging directory (``staged``).
The checkpoint is built under a hidden name beside ``final_hf``; the main job renames it into place once
the run's report is complete (``megatron_rl.job.main_job``), so a failed run leaves the previous
``final_hf`` as it was. A ``trainer.val_only`` run trains nothing and exports nothing. A SIGTERM / SIGINT during the export (or
pending from the last step) stops the run at once, as ``trainer.save_on_preemption`` has no step to finish.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Optional

from megatron_rl.job.prepare import staging_dir
from megatron_rl.trainer.callbacks import TrainerCallback
from megatron_rl.trainer.step_checkpoints import hf_num_params, last_good_checkpoint
from megatron_rl.trainer.watchdog import StopSignals
from parallel.checkpoint import DiskFullError, check_free_space, fmt_bytes, free_bytes, is_disk_full

__all__ = ["FinalExport"]


class FinalExport(TrainerCallback):
    """At the end of ``fit``: the actor as an HF checkpoint in a staging directory beside ``final``
    (``staged``, None until then); the free space is checked against its size first (``DiskFullError``
    naming what is needed and free, and the last good checkpoint)."""

    order = -10

    def __init__(self, final: Path):
        self.final = Path(final)
        self.staged: Optional[Path] = None

    def on_fit_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        if trainer.config.trainer.val_only:
            return
        signals = StopSignals.current()  # a signal now stops the run at once: there is no step to finish
        with signals.at_once() if signals is not None else contextlib.nullcontext():
            self._export(trainer)

    def _export(self, trainer: Any) -> None:
        final = self.final
        dtype = trainer.config.actor_rollout_ref.actor.megatron.dtype
        needed = hf_num_params(trainer.model_path) * (2 if dtype in ("bfloat16", "float16") else 4)
        check_free_space(
            final.parent, needed, "writing the HF checkpoint final_hf", hint=f"; {last_good_checkpoint(final.parent)}"
        )
        staged = staging_dir(final)
        try:
            self.staged = Path(trainer.save_hf_checkpoint(staged))
        except BaseException as err:
            shutil.rmtree(staged, ignore_errors=True)
            if is_disk_full(err):
                raise DiskFullError(
                    f"disk full: writing the HF checkpoint to {final} needs ~{fmt_bytes(needed)}, "
                    f"{fmt_bytes(free_bytes(final.parent))} are free; {last_good_checkpoint(final.parent)}",
                    path=final,
                    needed=needed,
                    free=free_bytes(final.parent),
                ) from err
            raise

    def discard(self) -> None:
        """Remove what is left of the staging directory (after the rename, nothing)."""
        if self.staged is not None and self.staged.exists():
            shutil.rmtree(self.staged, ignore_errors=True)

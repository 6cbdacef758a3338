"""SHARP models' checkpoints, written on a thread of their own while the devices train on
(a file of a whole model's state takes seconds), in the order they were asked for: each
model's checkpoint files and events are those of a job (``workers.pipeline.runner``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shoal.scheduler.devices import Device
from shoal.workers.checkpoint_events import write_checkpoint
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.error_text import one_line
from shoal.workers.sharp.models import ModelRun
from shoal.workers.snapshot import RunnerEvent, RunStatus
from shoal.workers.wire import receive_tree

Stop = Callable[[str, RunStatus, str], None]
"""How a model is ended once its tasks in flight are done: ``SharpTrainer._stop``."""


class CheckpointThread:
    """Writes checkpoints one after another on one thread."""

    def __init__(self, stop: Stop) -> None:
        self._stop = stop
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sharp-checkpoints")

    def write(
        self,
        model: ModelRun,
        step: int,
        blocks: dict[int, Any],
        devices: Sequence[Device],
        leave: bool = False,
    ) -> None:
        """Write ``model``'s checkpoint of ``step`` (its blocks' states in wire form); its
        last one ends it SUCCEEDED (SUSPENDED if it ``leave``s there), or FAILED if it
        cannot be written."""
        stages = [
            {
                "index": s.index,
                "replica": 0,
                "blocks": list(s.blocks),
                "device_id": devices[model.homes[s.index]].id,
            }
            for s in model.plan.shards
        ]
        self._thread.submit(self._write, model, step, blocks, stages, leave)

    def then(self, call: Callable[..., object], *args: Any) -> None:
        """``call(*args)`` once the checkpoints asked for so far are written (a model that
        ends LOST: its report then names them all)."""
        self._thread.submit(call, *args)

    def close(self) -> None:
        """Return once the checkpoints under way are written."""
        self._thread.shutdown(wait=True)

    def _write(
        self,
        model: ModelRun,
        step: int,
        blocks: dict[int, Any],
        stages: list[dict[str, Any]],
        leave: bool,
    ) -> None:
        snap = model.snap
        last = step == snap.steps or leave
        try:
            store = CheckpointStore(snap.checkpoint_root)
            tensors = receive_tree(blocks, torch.device("cpu"))
            event = write_checkpoint(store, snap, step, tensors, stages, (snap.micro_batches,))
        except Exception as exc:  # a boundary: the model fails with why, the others go on
            reason = f"its checkpoint of step {step} could not be written: {one_line(exc)}"
            if last:  # its shards are gone already
                model.end(RunStatus.FAILED, reason)
            else:
                self._stop(snap.job_id, RunStatus.FAILED, reason)
            return
        model.record(event)
        if leave:
            message = f"suspended at step {step}, checkpointed: resumes from there"
            model.record(RunnerEvent("suspended", step, message, {"step": step}))
            model.end(RunStatus.SUSPENDED)
        elif last:
            model.end(RunStatus.SUCCEEDED)

"""A step's batch, drawn by the stages that use it: the first stage its inputs, the last
its targets. The runner hands out which step and which rows, never the data.

A data source draws a step's batch as a function of the step alone (``workers.zoo.data``),
so a stage draws exactly the rows the runner would have drawn and sent (exactness
unchanged), where they are used: no hop through the runner and the object store, and on a
GPU straight from the worker's host memory to its device. Each replica's first and last
stages draw the whole batch and keep their rows (as a plain loop draws its batch in its
own loop); the time is booked as the stage's transfer time, as receiving the batch was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.zoo.data import DataSource, make_data


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` of step ``step``'s batch: one replica's micro-batches."""

    step: int
    start: int
    stop: int


class Draws:
    """A stage's own source of the job's batches, made at its first draw (only the first
    and last stages draw)."""

    def __init__(self, setup: StageSetup) -> None:
        self._setup = setup
        self._source: DataSource | None = None

    def take(
        self, rows: Rows, device: torch.device, *, inputs: bool, targets: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """The ``inputs`` and ``targets`` (each where asked, else None) of ``rows``, on
        ``device``."""
        if not (inputs or targets):
            return None, None
        x, y = self.batch(rows.step)
        if not 0 <= rows.start < rows.stop <= len(x):
            raise ValueError(
                f"rows [{rows.start}, {rows.stop}) of step {rows.step}'s batch asked for;"
                f" it has {len(x)} rows"
            )
        part = slice(rows.start, rows.stop)
        return (
            x[part].to(device) if inputs else None,
            y[part].to(device) if targets else None,
        )

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Step ``step``'s whole batch, inputs and targets, in host memory: drawn anew at
        each call (what it is drawn into may be changed in place by the model)."""
        setup = self._setup
        if setup.data is None:
            raise ValueError("this stage was built without the job's data: it cannot draw")
        if self._source is None:
            self._source = make_data(setup.data, setup.seed, setup.allowed)
        return self._source.batch(step, setup.batch_size)

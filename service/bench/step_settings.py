"""The sizes and settings of ``shoal bench step``, and its JSON object.

Pure on purpose (no torch, no Ray): the CLI reads the sizes for its options and the unit
tests check the arithmetic; ``service.bench.step`` measures.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shoal.service.bench.report import DEVICES
from shoal.workers.zoo.registry import data_meta, resolve_model

STEP_KEYS = (
    "plain_samples_per_s",
    "shoal_samples_per_s",
    "shoal_copies_samples_per_s",
    "shoal_over_plain",
    "copies_overhead",
    "stage_busy",
    "device",
    "machine",
    "notes",
    "model",
    "parameters",
    "batch",
    "micro_batches",
    "stages",
    "steps",
    "warmup",
    "repeats",
    "rounds",
)
"""The keys ``shoal bench step --json`` always prints."""

DATASETS = {"gpt": "synthetic-lm", "mlp": "synthetic-regression"}


@dataclass(frozen=True)
class Size:
    """One size of a bench model: its config, its data's config, the batch, its micro-batches."""

    model: Mapping[str, Any]
    data: Mapping[str, Any]
    batch: int
    micro_batches: int


SIZES: dict[str, dict[str, Size]] = {
    "gpt": {
        "tiny": Size(
            {"d_model": 32, "n_layers": 1, "n_heads": 2}, {"vocab_size": 64, "seq_len": 16}, 8, 2
        ),
        # ~3.3M parameters: ~0.3 s a step on one CPU thread, so a Ray call's few
        # milliseconds per micro-batch are visible without being the whole step.
        "small": Size(
            {"d_model": 256, "n_layers": 4, "n_heads": 4}, {"vocab_size": 256, "seq_len": 64}, 16, 4
        ),
        # The model: GPT, d_model 512, 8 layers, sequence 128, batch 32, 4 micro-batches.
        "large": Size(
            {"d_model": 512, "n_layers": 8, "n_heads": 8},
            {"vocab_size": 256, "seq_len": 128},
            32,
            4,
        ),
    },
    "mlp": {
        "tiny": Size({"hidden": 16, "layers": 2}, {"features": 8, "outputs": 4}, 8, 2),
        "small": Size({"hidden": 2048, "layers": 4}, {"features": 512, "outputs": 16}, 64, 4),
        "large": Size({"hidden": 4096, "layers": 8}, {"features": 1024, "outputs": 16}, 256, 4),
    },
}
"""Per model, its sizes by name; every size of every model has the same names."""

DEFAULT_SIZE = {"cpu": "small", "cuda": "large"}
"""A CPU runs the small size by default (a minute for the whole bench on 2 cores), a GPU the
issue's model."""


@dataclass(frozen=True)
class StepSettings:
    """What ``shoal bench step`` runs: one job (``model`` at ``size``, AdamW) on ``device``,
    plainly and through Shoal on ``stages`` devices; ``warmup`` steps, then ``repeats``
    windows of ``steps`` steps, each window one throughput, the median reported; all of it
    ``rounds`` times, the contenders in turn, each figure the median over the rounds."""

    device: str = "cpu"
    model: str = "gpt"
    size: str = "small"
    stages: int = 1
    steps: int = 5
    warmup: int = 2
    repeats: int = 3
    rounds: int = 1
    optimizer: str = "adamw"
    lr: float = 3e-4
    schedule: str = "1f1b"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is none of {', '.join(DEVICES)}")
        if self.model not in SIZES:
            raise ValueError(f"model {self.model!r} is none of {', '.join(sorted(SIZES))}")
        if self.size not in SIZES[self.model]:
            raise ValueError(f"size {self.size!r} is none of {', '.join(SIZES[self.model])}")
        if min(self.steps, self.repeats, self.rounds) < 1:
            raise ValueError("steps, repeats and rounds must be >= 1")
        if self.warmup < 1:
            raise ValueError(
                "warmup must be >= 1: Shoal's first step also starts its workers, so it is"
                " never timed"
            )
        if not 1 <= self.stages <= self.num_blocks:
            raise ValueError(
                f"stages ({self.stages}) must be 1..{self.num_blocks} (the {self.model}'s"
                " blocks); lower --stages or pick a larger --size"
            )

    @property
    def shape(self) -> Size:
        return SIZES[self.model][self.size]

    @property
    def dataset(self) -> str:
        return DATASETS[self.model]

    def _resolved(self) -> tuple[dict[str, Any], int, int]:
        _, meta = data_meta(self.dataset, dict(self.shape.data))
        model = resolve_model(self.model, dict(self.shape.model), meta)
        return model.config, model.num_blocks, model.param_count

    @property
    def num_blocks(self) -> int:
        return self._resolved()[1]

    @property
    def parameters(self) -> int:
        return self._resolved()[2]

    @property
    def timed_steps(self) -> int:
        """Every step a contender runs: the warm-up and the timed windows."""
        return self.warmup + self.repeats * self.steps

    def describe(self) -> str:
        """The model in words, e.g. ``gpt 3.3M parameters (d_model 256, ...), adamw``."""
        config = self._resolved()[0]
        shown = {**dict(self.shape.model), **dict(self.shape.data)}
        details = ", ".join(f"{k} {config.get(k, v)}" for k, v in shown.items())
        count = self.parameters
        amount = f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count / 1e3:.1f}k"
        return f"{self.model} {amount} parameters ({details}), {self.optimizer} lr {self.lr:g}"


def step_seconds(started: float, arrivals: Sequence[float]) -> list[float]:
    """Each step's seconds from when each step's metrics were seen (the first step's from
    ``started``): wall time between step boundaries, whatever the runner did in between.
    Steps seen together (one call carried them: ``scheduler.overlap``) share their gap."""
    times: list[float] = []
    before = started
    for seen, together in itertools.groupby(arrivals):
        count = len(list(together))
        times += [(seen - before) / count] * count
        before = seen
    return times


def step_result(
    s: StepSettings,
    *,
    plain: float,
    shoal: float,
    shoal_copies: float,
    shoal_over_plain: float,
    copies_overhead: float,
    stage_busy: Sequence[float],
    rounds: Sequence[Mapping[str, Any]],
    device: str,
    machine: dict[str, Any],
    notes: Sequence[str],
    started: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON object of ``shoal bench step``: the throughputs (samples/s, the median
    window's), Shoal's over the plain loop's, the copies' overhead (``copies_overhead``: in
    alternate windows of one run, ``copy_windows``), each the median over the rounds (the
    ratios taken within a round; each round's own under ``rounds``), the settings echoed;
    ``STEP_KEYS`` first."""
    return {
        "plain_samples_per_s": plain,
        "shoal_samples_per_s": shoal,
        "shoal_copies_samples_per_s": shoal_copies,
        "shoal_over_plain": shoal_over_plain,
        "copies_overhead": copies_overhead,
        "stage_busy": list(stage_busy),
        "device": device,
        "machine": machine,
        "notes": list(notes),
        "model": s.describe(),
        "parameters": s.parameters,
        "batch": s.shape.batch,
        "micro_batches": s.shape.micro_batches,
        "stages": s.stages,
        "steps": s.steps,
        "warmup": s.warmup,
        "repeats": s.repeats,
        "rounds": [dict(r) for r in rounds],
        **(extra or {}),
        "settings": asdict(s),
        "wall_s": round(time.perf_counter() - started, 1),
    }

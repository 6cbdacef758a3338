"""``shoal bench shard``: sharded replicas (ZeRO-1, ZeRO-2, ZeRO-3) against whole ones.

One model (an MLP of ``hidden`` x ``layers``, Adam) is trained by R replicas of one stage on R
virtual CPU devices (one thread each), for each R of ``replicas`` and each
``parallelism.shard`` mode: samples/s through the engine a job runs on (``Trainer`` and
``RayGroup``; the median over the timed steps of the engine's own step times) and its ratio
to whole replicas at the same R; and the state one device keeps between steps (its blocks'
parameters and optimizer state, sharded: its slices' share of it), measured on the engine's
own classes after two steps (R ranks of one gloo group in this process, a thread each) and
predicted by ``scheduler.memory.replica_state_bytes``; and what one replica's in-memory
copy holds (``elastic.keep_copies``: sharded, its slice of the parameters and optimizer
state), measured the same way and predicted by ``scheduler.memory.copy_bytes``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from shoal.scheduler.devices import Device
from shoal.scheduler.memory import copy_bytes, replica_state_bytes
from shoal.service.bench.pipeline import RUNNER_THREADS, ray_session, threads
from shoal.service.bench.report import BenchError, Progress, bench_job, machine
from shoal.service.bench.tensor_block import WAYS, tensor_block
from shoal.workers.blocks import Block, tensors_in
from shoal.workers.pipeline.collective import GlooCollective
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.local_ranks import run_ranks
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.sharding import SHARD_MODES, StageShards
from shoal.workers.profiler import trace_costs
from shoal.workers.snapshot import (
    DataRef,
    ModelRef,
    OptimizerConf,
    RunStatus,
    StagePlan,
)
from shoal.workers.zoo.data import loss_fn, make_data
from shoal.workers.zoo.models import build_blocks


@dataclass(frozen=True)
class ShardSettings:
    hidden: int = 1024
    layers: int = 4
    features: int = 256
    outputs: int = 16
    batch_size: int = 64
    micro_batches: int = 8
    replicas: tuple[int, ...] = (2, 4)
    steps: int = 12
    warmup: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps <= self.warmup:
            raise ValueError(f"--steps must exceed the {self.warmup} untimed ones")
        for r in self.replicas:
            if not 2 <= r <= self.micro_batches:
                raise ValueError(
                    f"--replicas {r}: between 2 and --micro-batches ({self.micro_batches})"
                )
        if self.batch_size % self.micro_batches:
            raise ValueError("--batch-size must be divisible by --micro-batches")

    def refs(self) -> tuple[ModelRef, DataRef, OptimizerConf]:
        return (
            ModelRef("mlp", None, {"hidden": self.hidden, "layers": self.layers}),
            DataRef(
                "synthetic-regression",
                None,
                {"features": self.features, "outputs": self.outputs},
            ),
            OptimizerConf("adam", 0.001),
        )


def phases(s: ShardSettings) -> list[str]:
    return [f"{r} replicas, shard {m}" for r in s.replicas for m in SHARD_MODES] + [
        f"one block, tensor parallelism {WAYS} against 1"
    ]


def measured_state_bytes(s: ShardSettings, replicas: int, mode: str) -> tuple[int, int]:
    """The most state any rank keeps after two steps: its blocks' bytes (parameters, and
    optimizer state when whole) and its shares' (``Stage.nbytes``'s count); and the most
    an in-memory copy of a rank holds then (what ``Stage.snapshot`` copies)."""
    model, data, opt = s.refs()
    source = make_data(data, s.seed, ())
    count = s.layers + 1
    sets = [
        [
            Block(i, m, opt)
            for i, m in enumerate(build_blocks(model, source.meta, s.seed, range(count)))
        ]
        for _ in range(replicas)
    ]
    loss = loss_fn(source.meta.task)

    def rank(collective: GlooCollective, r: int) -> tuple[int, int]:
        blocks = sets[r]
        shards = None if mode == "none" else StageShards(blocks, mode, collective)
        for step in range(2):
            x, y = source.batch(step * replicas + r, s.batch_size // replicas)
            out = x
            for block in blocks:
                out = block.module(out)
            loss(out, y).backward()  # type: ignore[no-untyped-call]
            if shards is None:
                collective.all_reduce(blocks)
                for block in blocks:
                    block.step()
                continue
            if mode == "full":
                shards.settle()  # reduce-scattered block by block in the backward
            elif mode == "gradients":
                shards.reduce_scatter(collective)
            else:
                collective.all_reduce(blocks)
            shards.update(None)
            shards.gather(collective)
        if shards is None:
            return sum(b.nbytes() for b in blocks), sum(
                t.nbytes for t in tensors_in([b.live_state() for b in blocks])
            )
        copy = sum(t.nbytes for t in tensors_in([c.live_state() for c in shards.shards]))
        return shards.held_bytes(), copy

    with threads(1):
        sizes = run_ranks(replicas, rank, timeout_s=120, name="bench-shard")
    failed = [e for e in sizes if isinstance(e, BaseException)]
    if failed:
        raise BenchError(f"measuring {replicas} replicas under shard {mode} failed: {failed[0]}")
    measured = [n for n in sizes if not isinstance(n, BaseException)]
    return max(held for held, _ in measured), max(copy for _, copy in measured)


def samples_per_s(
    s: ShardSettings, node_id: str, replicas: int, mode: str
) -> tuple[float, list[float]]:
    """Samples/s of ``replicas`` replicas of the whole model under ``mode`` (median of the
    engine's step times after the warm-up), and the run's losses."""
    plans = tuple(
        StagePlan(
            0,
            (0, s.layers + 1),
            Device(f"{node_id[:8]}-cpu-{r}", node_id, r, "cpu", 8192, False),
            replica=r,
        )
        for r in range(replicas)
    )
    with tempfile.TemporaryDirectory(prefix="shoal-bench-shard-") as root:
        snapshot = bench_job(
            f"bench-shard-{replicas}-{mode}",
            s.refs(),
            root,
            batch_size=s.batch_size,
            micro_batches=s.micro_batches,
            steps=s.steps,
            seed=s.seed,
            schedule="1f1b",
            stages=plans,
            num_blocks=s.layers + 1,
            replicas=replicas,
            shard=mode,
        )
        trainer = Trainer(snapshot, RayGroup)
        with threads(RUNNER_THREADS):
            status = trainer.run()
        report = trainer.report(0)
    if status is not RunStatus.SUCCEEDED:
        raise BenchError(f"{replicas} replicas under shard {mode} failed: {report.error}")
    times = [m.step_time_s for m in report.metrics][s.warmup :]
    return s.batch_size / statistics.median(times), [m.loss for m in report.metrics]


def run_shard(s: ShardSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Everything ``shoal bench shard`` reports (module docstring)."""
    started = time.perf_counter()
    model, data, _ = s.refs()
    costs = trace_costs(
        model, data, micro_batch_size=s.batch_size // s.micro_batches, optimizer="adam"
    )
    runs: list[dict[str, Any]] = []
    losses: dict[int, list[float]] = {}
    with ray_session(max(s.replicas)) as node_id:
        for replicas in s.replicas:
            for mode in SHARD_MODES:
                progress(f"{replicas} replicas, shard {mode}")
                rate, run_losses = samples_per_s(s, node_id, replicas, mode)
                losses.setdefault(replicas, run_losses)
                measured, copy = measured_state_bytes(s, replicas, mode)
                predicted = replica_state_bytes(costs, replicas, mode)
                predicted_copy = copy_bytes(costs, replicas, mode)
                runs.append(
                    {
                        "replicas": replicas,
                        "shard": mode,
                        "samples_per_s": rate,
                        "state_bytes_per_device": measured,
                        "predicted_state_bytes_per_device": predicted,
                        "prediction_error": predicted / measured - 1,
                        "copy_bytes_per_device": copy,
                        "predicted_copy_bytes_per_device": predicted_copy,
                        "copy_prediction_error": predicted_copy / copy - 1,
                        "loss_max_rel_diff": max(
                            abs(a - b) / max(abs(b), 1e-12)
                            for a, b in zip(run_losses, losses[replicas], strict=True)
                        ),
                    }
                )
    progress(f"one block, tensor parallelism {WAYS} against 1")
    split = tensor_block(
        s.refs(),
        costs,
        hidden=s.hidden,
        batch_size=s.batch_size,
        micro_batches=s.micro_batches,
        steps=s.steps,
        warmup=s.warmup,
        seed=s.seed,
    )
    whole = {r["replicas"]: r for r in runs if r["shard"] == "none"}
    params = sum(c.param_bytes for c in costs)
    for r in runs:
        base = whole[r["replicas"]]
        r["vs_none"] = r["samples_per_s"] / base["samples_per_s"]
        r["state_share"] = r["state_bytes_per_device"] / base["state_bytes_per_device"]
        # Of the optimizer state alone, where the parameters are whole (not ZeRO-3).
        r["optimizer_state_share"] = (
            None
            if r["shard"] == "full"
            else (r["state_bytes_per_device"] - params) / (base["state_bytes_per_device"] - params)
        )
    return {
        "runs": runs,
        "parameters": params // 4,
        "settings": {
            "hidden": s.hidden,
            "layers": s.layers,
            "batch_size": s.batch_size,
            "micro_batches": s.micro_batches,
            "steps": s.steps,
            "warmup": s.warmup,
            "optimizer": "adam",
        },
        "tensor": split,
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }

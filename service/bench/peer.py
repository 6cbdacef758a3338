"""The peer: ``torch.distributed.pipelining`` with gloo, on Shoal's bench model and schedule.

Two processes (``torch.multiprocessing.spawn``), one stage each, one thread each like a
Shoal virtual device and keeping freed host memory like Shoal's workers, a file store for
rendezvous (no port to pick). Each builds its stage's blocks exactly as Shoal does (same
seeds, same even partition) and trains the same batches with ``ScheduleGPipe``/
``Schedule1F1B`` over the same micro-batches; ``scale_grads`` makes the accumulated
gradients those of the mini-batch mean, as in Shoal.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.multiprocessing.spawn import ProcessException
from torch.multiprocessing.spawn import spawn as _untyped_spawn

from shoal.service.bench.report import BenchError, PipelineSettings, stage_bounds
from shoal.workers.host_memory import retain_freed_memory
from shoal.workers.zoo.data import loss_fn, make_data
from shoal.workers.zoo.models import build_blocks

_spawn: Any = _untyped_spawn  # untyped in torch
_SCHEDULES: dict[str, Any] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _rank(rank: int, world: int, store: str, fields: dict[str, Any], out: str) -> None:
    s = PipelineSettings(**fields)
    torch.set_num_threads(1)
    retain_freed_memory()  # as Shoal's workers do: the allocator is not what is compared
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model, data, _ = s.refs()
        source = make_data(data, s.seed, ())
        start, stop = stage_bounds(s.num_blocks, world)[rank]
        module = nn.Sequential(*build_blocks(model, source.meta, s.seed, range(start, stop)))
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = _SCHEDULES[s.schedule](stage, s.micro_batches, loss_fn=loss_fn(source.meta.task))
        optimizer = torch.optim.SGD(module.parameters(), lr=s.lr)
        times = []
        for step in range(s.timed_steps):
            started = time.perf_counter()
            inputs, targets = source.batch(step, s.batch_size)
            if rank == 0:
                schedule.step(inputs)
            elif rank == world - 1:
                schedule.step(target=targets, losses=[])
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
        dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def step_times(s: PipelineSettings) -> list[float]:
    """Seconds of each step on rank 0, whose step ends with the pipeline's last backward."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-pp-") as tmp:
        store, out = str(Path(tmp) / "store"), str(Path(tmp) / "times.json")
        try:
            _spawn(_rank, args=(s.stages, store, asdict(s), out), nprocs=s.stages, join=True)
        except ProcessException as exc:
            first = str(exc).strip().splitlines()[-1]
            raise BenchError(f"torch.distributed.pipelining failed: {first}") from exc
        times: list[float] = json.loads(Path(out).read_text())
    return times

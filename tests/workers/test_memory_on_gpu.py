"""The memory model against what a GPU holds: a stage's predicted peak is never under
``torch.cuda.max_memory_reserved()`` and at most 15% over, fp32 and bf16, GPipe and 1F1B;
so is the most a SHARP device accounted for while two models' shards alternated on it
(``tests.workers.sharp_memory``), with and without recompute.

One stage runs in this process (``LocalGroup``), so the allocator's peak is the stage's. The
prediction is ``scheduler.memory.stage_memory`` from the meta-device trace, plus the
allocator's workspaces a first matrix product reserves (cuBLAS's), measured before the run as
a worker measures its device's fixed overhead.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.scheduler.devices import Device
from shoal.scheduler.memory import format_bytes, in_flight, stage_memory
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.profiler import trace_costs
from shoal.workers.sharp.shard_host import ShardHost
from shoal.workers.sharp.shard_types import ShardKey
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf, RunStatus, StagePlan
from shoal.workers.wire import receive_tree
from tests.factories import job
from tests.workers.memory_cases import CASES, MICRO_BATCHES
from tests.workers.sharp_memory import alternate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MLP = (
    ModelRef("mlp", None, {"hidden": 4096, "layers": 8}),
    DataRef("synthetic-regression", None, {"features": 1024, "outputs": 16}),
    256,
)
GPT = (
    ModelRef("gpt", None, {"d_model": 512, "n_layers": 8, "n_heads": 8}),
    DataRef("synthetic-lm", None, {"vocab_size": 256, "seq_len": 128}),
    32,
)


def workspace_bytes(device: torch.device) -> int:
    """What the allocator holds after a first fp32 and bf16 matrix product and backward
    (cuBLAS's workspaces): part of a device's fixed overhead, there before any stage. What
    an earlier case left (its objects in reference cycles) is collected first."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    a = torch.randn(256, 256, device=device, requires_grad=True)
    (a @ a).sum().backward()  # type: ignore[no-untyped-call]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).sum().backward()  # type: ignore[no-untyped-call]
    del a
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


def predicted_and_peak(
    tmp_path: Path, case: str, precision: str, schedule: str, recompute: bool
) -> tuple[int, int, str]:
    model, data, batch = {"mlp": MLP, "gpt": GPT}[case]
    device = torch.device("cuda", 0)
    costs = trace_costs(
        model,
        data,
        micro_batch_size=batch // MICRO_BATCHES,
        optimizer="adamw",
        precision=precision,
    )
    blocks = (0, len(costs))
    need = stage_memory(
        costs,
        blocks,
        micro_batch_size=batch // MICRO_BATCHES,
        in_flight=in_flight(schedule, 1, 0, MICRO_BATCHES),
        recompute=recompute,
        precision=precision,
    )
    workspace = workspace_bytes(device)
    torch.cuda.reset_peak_memory_stats(device)
    gpu = Device("gpu-0", "node-0", 0, "gpu", 40960, gpu=True)
    snap = job(
        tmp_path,
        [blocks],
        model=model,
        data=data,
        optimizer=OptimizerConf("adamw", 3e-4),
        batch_size=batch,
        micro_batches=MICRO_BATCHES,
        steps=3,
        schedule=schedule,
        recompute=recompute,
        precision=precision,
        num_blocks=len(costs),
        stages=(StagePlan(0, blocks, gpu),),
    )
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    peak = int(torch.cuda.max_memory_reserved(device))
    predicted = need.total + workspace
    state = (
        f"{case} {precision} {schedule} recompute={recompute}: predicted"
        f" {format_bytes(predicted)} ({need}, workspace {format_bytes(workspace)}),"
        f" peak reserved {format_bytes(peak)} ({predicted / peak:.3f}x)"
    )
    return predicted, peak, state


@pytest.mark.parametrize(("case", "precision", "schedule", "recompute"), CASES)
def test_a_stage_holds_what_was_predicted_never_more_and_at_most_15_percent_less(
    tmp_path: Path, case: str, precision: str, schedule: str, recompute: bool
) -> None:
    predicted, peak, state = predicted_and_peak(tmp_path, case, precision, schedule, recompute)
    print(state)  # docs/architecture.md's table reads them (pytest -s)
    assert peak <= predicted <= 1.15 * peak, state


@pytest.mark.parametrize(
    ("precision", "recompute"), [(p, r) for p in ("fp32", "bf16") for r in (False, True)]
)
def test_a_sharp_device_holds_what_it_accounted_for_never_more_and_at_most_15_percent_less(
    precision: str, recompute: bool
) -> None:
    device = torch.device("cuda", 0)
    workspace = workspace_bytes(device)
    torch.cuda.reset_peak_memory_stats(device)
    gpu = Device("gpu-0", "node-0", 0, "gpu", 40960, gpu=True)
    trace: list[str] = []  # per task, for a failure: where the device went past the account

    def probe(key: ShardKey, held: dict[str, Any]) -> None:  # no sync: it would lower peaks
        now = held["resident_bytes"] + held["residue_bytes"]
        trace.append(
            f"  {key}: accounted {format_bytes(now)}, allocated"
            f" {format_bytes(torch.cuda.memory_allocated(device))}, peak allocated"
            f" {format_bytes(torch.cuda.max_memory_allocated(device))}, peak reserved"
            f" {format_bytes(torch.cuda.max_memory_reserved(device))}"
        )

    host, accounted, tasks = alternate(gpu, precision, recompute, probe=probe)
    peak = int(torch.cuda.max_memory_reserved(device))
    allocated = int(torch.cuda.max_memory_allocated(device))
    predicted = accounted + workspace
    state = (
        f"SHARP gpt {precision} recompute={recompute}, {tasks} tasks: accounted at most"
        f" {format_bytes(accounted)} of a budget of {format_bytes(host.budget_bytes)},"
        f" + workspace {format_bytes(workspace)}; peak reserved {format_bytes(peak)}"
        f" ({predicted / peak:.3f}x), peak allocated {format_bytes(allocated)}"
    )
    print(state)  # docs/architecture.md reads them (pytest -s)
    assert peak <= predicted <= 1.15 * peak, "\n".join([state, *trace])
    assert accounted <= host.budget_bytes, "\n".join([state, *trace])


def test_sharp_shards_through_pinned_host_memory_train_as_on_the_host() -> None:
    """The same alternation on the GPU (every shard promoted and demoted again and again,
    asynchronously through its pinned buffers, its optimizer never rebuilt) and on a CPU
    device (nothing moves) ends with the same parameters and optimizer state, to float
    tolerance: a copy read before it had landed, or memory reused under one, would not."""
    gpu = Device("gpu-0", "node-0", 0, "gpu", 40960, gpu=True)
    cpu = Device("cpu-0", "node-0", 0, "cpu", 40960, gpu=False)
    on_gpu, _, tasks = alternate(gpu, "fp32", recompute=False)
    on_cpu, _, _ = alternate(cpu, "fp32", recompute=False)
    shards = on_gpu.held()["shards"]
    assert tasks > 2 * len(shards) and shards == on_cpu.held()["shards"]
    for key in shards:
        got, want = _state(on_gpu, key), _state(on_cpu, key)
        assert sorted(got) == sorted(want), key
        for index, block in want.items():
            for part in ("module", "optimizer"):
                flat_got, flat_want = _tensors(got[index][part]), _tensors(block[part])
                assert flat_want and len(flat_got) == len(flat_want), (key, index, part)
                for a, b in zip(flat_got, flat_want, strict=True):
                    assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5), (
                        key,
                        index,
                        part,
                    )


def _state(host: ShardHost, key: ShardKey) -> dict[int, Any]:
    """Shard ``key``'s block states on ``host``, as host tensors (its first copy)."""
    host.copy(key, 2, 1)
    states, _, _ = host.copied(key, 1, 60.0)
    return {i: receive_tree(s, torch.device("cpu")) for i, s in states.items()}


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in a block's state, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []

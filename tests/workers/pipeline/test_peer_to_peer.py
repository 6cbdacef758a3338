"""Stages run whole steps and exchange activations peer to peer: bitwise the relayed
reference, links formed only where missing, and a failure blamed on the stage it began at."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.scheduler.devices import Device
from shoal.scheduler.types import BlockRange
from shoal.workers.pipeline.batch_rows import Rows
from shoal.workers.pipeline.group import RayGroup, _mixed_pair
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.stage_worker import StageFailed
from shoal.workers.pipeline.worker_group import StageLost
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf, RunStatus, StagePlan
from shoal.workers.zoo.data import make_data
from tests.factories import GPT, SGD, TOKENS, dp_plans, even_ranges, job, plans
from tests.workers.runs import assert_bitwise_equal, final_states

pytestmark = pytest.mark.integration

MODEL = ModelRef("mlp", None, {"hidden": 16, "layers": 3})
DATA = DataRef("synthetic-regression", None, {"features": 8, "outputs": 2})


@pytest.fixture
def node(ray_address: str) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


CASES = {
    "gpipe-3-stages": {"schedule": "gpipe", "micro_batches": 4},
    "1f1b-3-stages-recompute": {"schedule": "1f1b", "micro_batches": 8, "recompute": True},
    "gpt-bf16-clipped": {
        "schedule": "1f1b",
        "micro_batches": 4,
        "model": GPT,
        "data": TOKENS,
        "precision": "bf16",
        "optimizer": replace(SGD, clip_grad_norm=0.05),
    },
}


@pytest.mark.parametrize("case", CASES)
def test_peer_to_peer_steps_equal_the_relayed_reference_bitwise(
    node: str, tmp_path: Path, case: str
) -> None:
    fields = {"batch_size": 16, "steps": 3, **CASES[case]}
    ranges = even_ranges(4, 3)
    snap = job(tmp_path / "ray", ranges, stages=plans(ranges, node), **fields)
    trainer = Trainer(snap, RayGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    report = trainer.report(0)
    (transport,) = [e for e in report.events if e.kind == "transport"]
    assert transport.data == {"relayed": None}, transport.message
    local = replace(snap, checkpoint_root=str(tmp_path / "local"), stages=plans(ranges))
    reference = Trainer(local, LocalGroup)
    assert reference.run() is RunStatus.SUCCEEDED, reference.report(0).error
    assert_bitwise_equal(final_states(snap), final_states(local))
    assert [m.loss for m in report.metrics] == [m.loss for m in reference.report(0).metrics]
    assert [m.grad_norm for m in report.metrics] == [
        m.grad_norm for m in reference.report(0).metrics
    ]
    for m in report.metrics:  # one call per worker: compute is measured on every stage
        assert all(t.compute_s > 0 for t in m.stages)


def test_replicated_peer_to_peer_pipelines_equal_the_relayed_reference(
    node: str, tmp_path: Path
) -> None:
    stages = dp_plans([(0, 2), (2, 4)], 2, node)
    snap = job(
        tmp_path / "ray",
        [],
        stages=stages,
        replicas=2,
        micro_batches=4,
        replica_micro_batches=(1, 3),
        recompute=True,
    )
    trainer = Trainer(snap, RayGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert all(t.allreduce_s > 0 for m in trainer.report(0).metrics for t in m.stages)
    local = replace(
        snap, checkpoint_root=str(tmp_path / "local"), stages=dp_plans([(0, 2), (2, 4)], 2)
    )
    assert Trainer(local, LocalGroup).run() is RunStatus.SUCCEEDED
    assert_bitwise_equal(final_states(snap), final_states(local))


def test_a_relayout_from_replicas_to_a_pipeline_trains_on_exactly(
    node: str, tmp_path: Path
) -> None:
    """2 replicas x 2 stages, then (after step 1) one 2-stage pipeline on two of those
    devices: the leftover replicas leave their data-parallel groups, the kept workers
    link as neighbours, and the run equals the same moves made in-process, bitwise."""
    before = dp_plans([(0, 2), (2, 4)], 2, node)
    fields = {"replicas": 2, "micro_batches": 4, "replica_micro_batches": (2, 2), "steps": 3}

    def run(stages: Any, root: Path, make: Any) -> Trainer:
        snap = job(root, [], stages=stages, **fields)
        trainer = Trainer(snap, make)
        pipeline = [replace(p, replica=0) for p in stages[2:]]
        trainer.relayout(pipeline, (4,))  # carried out at the first step boundary
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        return trainer

    trainer = run(before, tmp_path / "ray", RayGroup)
    moves = [e.data for e in trainer.report(0).events if e.kind == "relayout"]
    assert [m["micro_batches"] for m in moves] == [[4]]
    local = run(dp_plans([(0, 2), (2, 4)], 2), tmp_path / "local", LocalGroup)
    snap = job(tmp_path / "ray", [], stages=before, **fields)
    assert_bitwise_equal(
        final_states(snap), final_states(replace(snap, checkpoint_root=str(tmp_path / "local")))
    )
    assert [m.loss for m in trainer.report(0).metrics] == [m.loss for m in local.report(0).metrics]


# ------------------------------------------------------------------ the group, by hand


def stage_plans(ranges: list[BlockRange], node: str, first: int = 0) -> list[StagePlan]:
    return [
        StagePlan(i, r, Device(f"{node[:8]}-cpu-{first + i}", node, first + i, "cpu", 2048, False))
        for i, r in enumerate(ranges)
    ]


@pytest.fixture
def setup() -> StageSetup:
    meta = make_data(DATA, 7).meta
    optimizer = OptimizerConf("adam", 0.01)
    return StageSetup(MODEL, meta, optimizer, 7, 4, data=DATA, batch_size=8)


@pytest.fixture
def group(node: str, setup: StageSetup) -> Iterator[RayGroup]:
    made = RayGroup(stage_plans([(0, 1), (1, 3), (3, 4)], node), setup)
    yield made
    made.shutdown()


def step_calls(group: RayGroup, *, targets: bool = True) -> list[Any]:
    """Step 0's calls; without ``targets``, the last stage is asked for rows past the
    batch's 8."""
    rows = Rows(0, 0, 8)
    last = rows if targets else Rows(0, 8, 16)
    return [
        group.submit(0, "step", "1f1b", 3, 4, rows, 0.25, True),
        group.submit(1, "step", "1f1b", 3, 4, rows, 0.25, True),
        group.submit(2, "step", "1f1b", 3, 4, last, 0.25, True),
    ]


def names(group: RayGroup) -> list[dict[int, str]]:
    return group.get([group.submit(w, "link_names") for w in range(3)], 30)


def test_links_form_once_and_only_changed_pairs_are_formed_again(
    group: RayGroup, node: str
) -> None:
    assert group.connect() is None
    first = names(group)
    assert first[0].keys() == {1} and first[1].keys() == {-1, 1} and first[2].keys() == {-1}
    assert first[0][1] == first[1][-1] and first[1][1] == first[2][-1]
    assert group.connect() is None
    assert names(group) == first  # nothing missing: nothing formed
    group.get(step_calls(group), 60)
    # A new worker replaces the last stage: only the pair it is in is formed again.
    moved = StagePlan(2, (3, 4), Device(f"{node[:8]}-cpu-3", node, 3, "cpu", 2048, False))
    group.regroup([*stage_plans([(0, 1), (1, 3)], node), moved], {0: 0, 1: 1})
    group.retire()
    assert group.connect() is None
    after = names(group)
    assert after[0] == first[0]
    assert after[1][-1] == first[1][-1] and after[1][1] != first[1][1]
    assert after[1][1] == after[2][-1]


def test_a_stage_error_mid_step_is_blamed_on_that_stage_and_its_neighbours_stop_at_once(
    group: RayGroup,
) -> None:
    assert group.connect() is None
    before = names(group)
    started = time.monotonic()
    with pytest.raises(StageFailed, match=r"stage 2 failed in step: .*it has 8 rows") as failed:
        group.get(step_calls(group, targets=False), 120)
    assert type(failed.value) is StageFailed  # the cause, not a neighbour's broken link
    assert time.monotonic() - started < 20  # the neighbours did not wait out a timeout
    assert names(group) == [{}, {}, {}]  # every stage closed its links
    group.disconnect()
    assert group.connect() is None  # formed again, under new names
    after = names(group)
    shared = [set(a.values()) & set(b.values()) for a, b in zip(before, after, strict=True)]
    assert shared == [set()] * 3
    assert after[0][1] == after[1][-1] and after[1][1] == after[2][-1]


def test_a_killed_stage_is_lost_and_its_neighbours_are_not_blamed(group: RayGroup) -> None:
    assert group.connect() is None
    group.get(step_calls(group), 60)
    (pid,) = group.get([group.submit(1, "pid")], 30)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(StageLost) as lost:
        group.get(step_calls(group), 120)
    assert lost.value.stage == 1, lost.value
    assert time.monotonic() - started < 40


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_job_on_a_gpu_steps_in_one_call_and_equals_the_relayed_reference(
    node: str, tmp_path: Path, precision: str
) -> None:
    """One stage on the GPU: its step runs in one call, losses read once per step; the
    same job relayed in-process on the same GPU gives the same bits."""
    gpu = Device(f"{node[:8]}-gpu-0", node, 0, "gpu", 40960, gpu=True)
    stages = (StagePlan(0, (0, 4), gpu),)
    fields = {"batch_size": 16, "micro_batches": 4, "precision": precision}
    snap = job(tmp_path / "ray", [(0, 4)], stages=stages, **fields)
    trainer = Trainer(snap, RayGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    local = replace(snap, checkpoint_root=str(tmp_path / "local"))
    reference = Trainer(local, LocalGroup)
    assert reference.run() is RunStatus.SUCCEEDED, reference.report(0).error
    assert_bitwise_equal(final_states(snap), final_states(local))
    assert [m.loss for m in trainer.report(0).metrics] == [
        m.loss for m in reference.report(0).metrics
    ]
    (held,) = [e for e in trainer.report(0).events if e.kind == "device_memory"]
    assert held.data["device_id"] == gpu.id and held.data["overhead_bytes"] > 0, held.message
    speeds = [e.data["gflops"] for e in trainer.report(0).events if e.kind == "device_speed"]
    assert speeds and speeds[0] > 1000  # compute-bound: a GPU is measured in TFLOP/s


def test_a_gpu_stage_next_to_a_cpu_stage_is_relayed_with_the_reason() -> None:
    """A link is NCCL between GPUs and a socket between CPUs: a mixed pair has none."""
    ranges = even_ranges(3, 3)
    cpus = plans(ranges)
    gpu = replace(cpus[1].device, id="n0000000-gpu-1", kind="h100", gpu=True)
    mixed = (cpus[0], replace(cpus[1], device=gpu), cpus[2])
    assert _mixed_pair(cpus, [0, 1]) is None
    reason = _mixed_pair(mixed, [0, 1])
    assert reason is not None
    assert "n0000000-gpu-1" in reason and "a GPU" in reason and "a CPU" in reason

"""The pipeline engine trains exactly like one process, resumes anywhere, and reports."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.job_runner import JobRunner
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.worker_group import Handle, WorkerGroup
from shoal.workers.snapshot import (
    JobSnapshot,
    ModelRef,
    OptimizerConf,
    RunStatus,
    StagePlan,
)
from tests.factories import (
    ADAM,
    GPT,
    MLP,
    REGRESSION,
    SGD,
    TOKENS,
    dp_plans,
    even_ranges,
    job,
    plans,
)
from tests.workers.runs import assert_matches_reference, final_states, metrics, reference


@st.composite
def pipelines(draw: st.DrawFn) -> dict[str, Any]:
    stages = draw(st.integers(1, 4))
    cuts = sorted(draw(st.sets(st.integers(1, 3), min_size=stages - 1, max_size=stages - 1)))
    bounds = [0, *cuts, 4]
    micro_batches = draw(st.sampled_from([1, 2, 4]))
    lm = draw(st.booleans())
    optimizer = draw(st.sampled_from([ADAM, OptimizerConf("sgd", 0.1, {"momentum": 0.9})]))
    # Gradient norms here are 0.2-1: 0.05 always clips, 10 never does.
    clip = draw(st.sampled_from([None, 0.05, 10.0]))
    return {
        "ranges": list(pairwise(bounds)),
        "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
        "recompute": draw(st.booleans()),
        "micro_batches": micro_batches,
        "steps": draw(st.integers(1, 3)),
        "model": GPT if lm else MLP,
        "data": TOKENS if lm else REGRESSION,
        "optimizer": replace(optimizer, clip_grad_norm=clip),
        "precision": draw(st.sampled_from(["fp32", "bf16"])),
    }


@pytest.mark.unit
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_pipelines_train_exactly_like_one_process(config: dict[str, Any]) -> None:
    ranges = config.pop("ranges")
    with tempfile.TemporaryDirectory() as root:
        snap = job(root, ranges, **config)
        trainer = Trainer(snap, LocalGroup)
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        assert_matches_reference(snap, metrics(trainer))


@st.composite
def hybrids(draw: st.DrawFn) -> dict[str, Any]:
    """Pipeline x data parallel: 1-3 replicas of 1-3 stages, even or uneven splits."""
    replicas = draw(st.integers(1, 3))
    stages = draw(st.integers(1, 3))
    cuts = sorted(draw(st.sets(st.integers(1, 3), min_size=stages - 1, max_size=stages - 1)))
    micro_batches = draw(st.sampled_from([m for m in (1, 2, 3, 4, 6) if m >= replicas]))
    split: tuple[int, ...] = ()
    if replicas > 1 and draw(st.booleans()):  # a faster replica takes more micro-batches
        bars = sorted(
            draw(
                st.sets(
                    st.integers(1, micro_batches - 1), min_size=replicas - 1, max_size=replicas - 1
                )
            )
        )
        split = tuple(b - a for a, b in pairwise([0, *bars, micro_batches]))
    lm = draw(st.booleans())
    return {
        "stages": dp_plans(list(pairwise([0, *cuts, 4])), replicas),
        "replicas": replicas,
        "replica_micro_batches": split,
        "batch_size": 12,
        "micro_batches": micro_batches,
        "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
        "recompute": draw(st.booleans()),
        "steps": draw(st.integers(1, 2)),
        "model": GPT if lm else MLP,
        "data": TOKENS if lm else REGRESSION,
        "optimizer": replace(SGD, clip_grad_norm=draw(st.sampled_from([None, 0.05]))),
    }


@pytest.mark.unit
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrids())
def test_replicated_pipelines_train_like_one_process(config: dict[str, Any]) -> None:
    """Exact to rtol=1e-5, atol=1e-6, not bitwise: the replicas' partial gradient sums are
    added after each is accumulated ((g0 + g1) + (g2 + g3)), the reference adds micro-batch
    by micro-batch (((g0 + g1) + g2) + g3), so float rounding differs, and so does the
    clipping coefficient computed from them. SGD, because Adam's division by sqrt(v) blows
    the rounding of near-zero gradients up past the tolerance (see
    tests/workers/test_reference.py)."""
    with tempfile.TemporaryDirectory() as root:
        snap = job(root, [], **config)
        trainer = Trainer(snap, LocalGroup)
        assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
        assert_matches_reference(snap, metrics(trainer))


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_clipped_pipeline_is_bitwise_torchs_clip_grad_norm(
    tmp_path: Path, precision: str
) -> None:
    """Pipelines without replicas accumulate the very gradients of one process, and the
    per-tensor norms are folded as clip_grad_norm_ folds them: the same bits, under bf16
    autocast too."""
    snap = job(
        tmp_path,
        [(0, 1), (1, 3), (3, 4)],
        optimizer=replace(SGD, clip_grad_norm=0.05),
        precision=precision,
        recompute=True,
        micro_batches=4,
    )
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    ref = reference(snap)
    norms = [m.grad_norm for m in metrics(trainer)]
    assert norms == ref.grad_norms
    assert all(n is not None and n > 0.05 for n in norms)  # the coefficient was below 1
    unclipped = reference(replace(snap, optimizer=SGD))
    states = final_states(snap)
    for block, free in zip(ref.blocks, unclipped.blocks, strict=True):
        for name, expected in block.module.state_dict().items():
            assert torch.equal(states[block.index]["module"][name], expected), (block.index, name)
            assert not torch.equal(expected, free.module.state_dict()[name]), (block.index, name)


@pytest.mark.unit
def test_replicas_report_per_device_timings_and_a_summed_loss(tmp_path: Path) -> None:
    snap = job(
        tmp_path,
        [],
        stages=dp_plans([(0, 2), (2, 4)], 2),
        replicas=2,
        micro_batches=4,
        replica_micro_batches=(3, 1),
        optimizer=SGD,
        steps=2,
    )
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    report = trainer.report(0)
    placement = report.events[0]
    assert placement.message.startswith("2 stages x 2 replicas:")
    assert [(s["stage"], s["replica"]) for s in placement.data["stages"]] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    assert len([e for e in report.events if e.kind == "device_speed"]) == 4
    for m in report.metrics:
        assert [(t.stage, t.replica, t.device_id) for t in m.stages] == [
            (0, 0, "n0000000-cpu-0"),
            (1, 0, "n0000000-cpu-1"),
            (0, 1, "n0000000-cpu-2"),
            (1, 1, "n0000000-cpu-3"),
        ]
        assert all(t.compute_s > 0 and t.allreduce_s >= 0 for t in m.stages)
    manifest, states = CheckpointStore(tmp_path).read("job-1", 2)
    assert manifest["layout"]["replicas"] == 2
    assert manifest["layout"]["replica_micro_batches"] == [3, 1]
    assert sorted(states) == [0, 1, 2, 3]
    assert_matches_reference(snap, report.metrics)


@pytest.mark.unit
@pytest.mark.parametrize(("before", "after"), [((2, 2), (1, 3)), ((1, 2), (3, 1))])
def test_a_checkpoint_restores_onto_another_replica_count(
    tmp_path: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    def layout(replicas: int, stages: int, steps: int) -> JobSnapshot:
        ranges = even_ranges(4, stages)
        return job(
            tmp_path,
            [],
            stages=dp_plans(ranges, replicas),
            replicas=replicas,
            steps=steps,
            micro_batches=4,
            optimizer=SGD,
        )

    assert Trainer(layout(*before, steps=2), LocalGroup).run() is RunStatus.SUCCEEDED
    second = layout(*after, steps=4)
    trainer = Trainer(second, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert [m.step for m in trainer.report(0).metrics] == [3, 4]
    assert_matches_reference(second, trainer.report(0).metrics)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {
                "stages": (
                    *plans([(0, 2), (2, 4)]),
                    StagePlan(0, (0, 4), plans([(0, 4)])[0].device, replica=1),
                ),
                "replicas": 2,
            },
            r"^PlanError: replica 1 has stage ranges \[\(0, 4\)\], replica 0 has",
        ),
        ({"replicas": 2}, r"^PlanError: the stages name replicas \[0\]; a job of 2 replicas"),
        (
            {
                "stages": dp_plans([(0, 2), (2, 4)], 2),
                "replicas": 2,
                "replica_micro_batches": (2, 1),
            },
            r"^ValueError: replica_micro_batches \[2, 1\] must give each of the 2 replicas",
        ),
        (
            {"stages": dp_plans([(0, 4)], 3), "replicas": 3},
            r"^ValueError: 2 micro-batches cannot be split over 3 replicas",
        ),
    ],
)
def test_bad_replica_layouts_fail_with_a_reason(
    tmp_path: Path, fields: dict[str, Any], reason: str
) -> None:
    trainer = Trainer(job(tmp_path, [(0, 2), (2, 4)], **fields), LocalGroup)
    assert trainer.run() is RunStatus.FAILED
    error = trainer.report(0).error
    assert error is not None and re.search(reason, error), error


@pytest.mark.unit
def test_a_resumed_job_continues_exactly_on_another_partition(tmp_path: Path) -> None:
    first = job(tmp_path, [(0, 1), (1, 4)], steps=2, schedule="gpipe")
    assert Trainer(first, LocalGroup).run() is RunStatus.SUCCEEDED
    second = job(tmp_path, [(0, 2), (2, 3), (3, 4)], steps=5, recompute=True, micro_batches=4)
    trainer = Trainer(second, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED
    report = trainer.report(0)
    resumed = [e for e in report.events if e.kind == "resumed"]
    assert [(e.step, e.data["step"]) for e in resumed] == [(2, 2)]
    assert [m.step for m in report.metrics] == [3, 4, 5]
    # The first two steps ran with 2 micro-batches; the reference runs all five with 4.
    # Same mini-batches, so the parameters agree (the micro-batch split only reorders sums).
    assert_matches_reference(second, report.metrics)


def corrupt(root: Path, job_id: str, step: int) -> None:
    """Flip one byte of a block file of the checkpoint at ``step`` (its size unchanged)."""
    target = next((root / job_id / f"step-{step:08d}").glob("block-*.pt"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))


@pytest.mark.unit
@pytest.mark.parametrize(("corrupted", "resumed_at"), [((4,), 2), ((2, 4), 0)])
def test_a_corrupt_checkpoint_is_passed_over_for_the_previous_good_one(
    tmp_path: Path, corrupted: tuple[int, ...], resumed_at: int
) -> None:
    """Checksums catch a damaged checkpoint; the run resumes from the newest good one (or
    from its seed if none is), says which it passed over and why, and stays exact."""
    first = job(tmp_path, [(0, 2), (2, 4)], steps=4, checkpoint_every=2, checkpoint_keep=3)
    assert Trainer(first, LocalGroup).run() is RunStatus.SUCCEEDED
    for step in corrupted:
        corrupt(tmp_path, first.job_id, step)
    second = job(tmp_path, [(0, 2), (2, 4)], steps=6, checkpoint_every=2, checkpoint_keep=3)
    trainer = Trainer(second, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED
    report = trainer.report(0)
    (resumed,) = [e for e in report.events if e.kind == "resumed"]
    assert resumed.step == resumed.data["step"] == resumed_at
    assert [s["step"] for s in resumed.data["skipped"]] == sorted(corrupted, reverse=True)
    assert all("does not match its checksum" in s["reason"] for s in resumed.data["skipped"])
    assert "passed over as unusable" in resumed.message
    assert [m.step for m in report.metrics] == list(range(resumed_at + 1, 7))
    assert_matches_reference(second, report.metrics)


@pytest.mark.unit
def test_events_metrics_and_checkpoint_retention(tmp_path: Path) -> None:
    snap = job(tmp_path, [(0, 2), (2, 4)], steps=5, checkpoint_every=2, checkpoint_keep=2)
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.SUCCEEDED
    report = trainer.report(0)
    assert (report.status, report.step, report.error) == (RunStatus.SUCCEEDED, 5, None)
    kinds = [e.kind for e in report.events]
    assert kinds == [
        "placement",
        "device_speed",
        "device_speed",
        "transport",
        *["checkpoint"] * 3,
    ]
    (transport,) = [e for e in report.events if e.kind == "transport"]
    assert transport.data == {
        "relayed": "an in-process group relays activations through its runner"
    }
    placement = report.events[0].data["stages"]
    assert [(s["stage"], s["blocks"], s["device_id"]) for s in placement] == [
        (0, [0, 2], "n0000000-cpu-0"),
        (1, [2, 4], "n0000000-cpu-1"),
    ]
    assert all(s["bytes"] > 0 for s in placement)
    assert all(e.data["gflops"] > 0 for e in report.events if e.kind == "device_speed")
    checkpoints = [e.data for e in report.events if e.kind == "checkpoint"]
    assert [(c["step"], c["deleted"]) for c in checkpoints] == [(2, []), (4, []), (5, [2])]
    assert all(c["bytes"] > 0 and Path(c["path"]).name for c in checkpoints)
    assert [i.step for i in CheckpointStore(tmp_path).list("job-1")] == [4, 5]
    manifest, _ = CheckpointStore(tmp_path).read("job-1", 5)
    assert manifest["layout"]["stages"][1]["blocks"] == [2, 4]
    for m in report.metrics:
        assert m.samples_per_s == pytest.approx(8 / m.step_time_s)
        assert [t.stage for t in m.stages] == [0, 1]
        for t in m.stages:
            assert t.compute_s > 0
            assert t.compute_s + t.transfer_s + t.idle_s == pytest.approx(m.step_time_s)


@pytest.mark.unit
def test_report_cursor_returns_only_news(tmp_path: Path) -> None:
    trainer = Trainer(job(tmp_path, [(0, 4)], steps=2), LocalGroup)
    before = trainer.report(0)
    assert (before.status, before.cursor, before.metrics, before.events) == (
        RunStatus.RUNNING,
        0,
        (),
        (),
    )
    trainer.run()
    everything = trainer.report(0)
    assert len(everything.metrics) == 2 and everything.cursor == 2 + len(everything.events)
    tail = trainer.report(everything.cursor - 1)
    assert (len(tail.metrics), len(tail.events)) == (0, 1)  # the final checkpoint
    assert trainer.report(everything.cursor).metrics == ()


class _AskOnStep:
    """A LocalGroup that asks its trainer to ``request`` (cancel, suspend) when step ``at``
    is applied."""

    def __init__(self, trainer: list[Trainer], at: int, request: str, *args: Any) -> None:
        self._inner = LocalGroup(*args)
        self._trainer, self._at, self._request, self._steps = trainer, at, request, 0

    def submit(self, stage: int, method: str, *args: Any) -> Handle:
        if method == "apply_step" and stage == 0:
            self._steps += 1
            if self._steps == self._at:
                getattr(self._trainer[0], self._request)()
        return self._inner.submit(stage, method, *args)

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        return self._inner.get(handles, timeout)

    def all_reduce(self, workers: Sequence[int]) -> list[Handle]:
        return self._inner.all_reduce(workers)

    def connect(self) -> str | None:
        return self._inner.connect()

    def disconnect(self) -> None:
        self._inner.disconnect()

    def shutdown(self) -> None:
        self._inner.shutdown()


@pytest.mark.unit
def asking(request: str, at: int, snap: JobSnapshot) -> Trainer:
    """A trainer of ``snap`` that is asked to ``request`` while step ``at`` runs."""
    holder: list[Trainer] = []

    def make(plans: Sequence[StagePlan], setup: StageSetup) -> WorkerGroup:
        return _AskOnStep(holder, at, request, plans, setup)

    holder.append(Trainer(snap, make))
    return holder[0]


@pytest.mark.unit
def test_cancel_stops_at_the_next_step_boundary(tmp_path: Path) -> None:
    trainer = asking("cancel", 2, job(tmp_path, [(0, 2), (2, 4)], steps=5))
    assert trainer.run() is RunStatus.CANCELLED
    report = trainer.report(0)
    assert (report.status, report.step) == (RunStatus.CANCELLED, 2)
    assert CheckpointStore(tmp_path).list("job-1") == []


@pytest.mark.unit
@pytest.mark.parametrize("every", [0, 2])
def test_suspend_checkpoints_the_step_it_stops_at_and_a_new_run_replays_nothing(
    tmp_path: Path, every: int
) -> None:
    """Asked to suspend during step 2 (a checkpoint due there or not), the runner stops
    after it with step 2 checkpointed once; a runner on another partition goes on from step
    3, and the whole run equals one process's."""
    first = asking("suspend", 2, job(tmp_path, [(0, 2), (2, 4)], steps=5, checkpoint_every=every))
    assert first.run() is RunStatus.SUSPENDED
    report = first.report(0)
    assert (report.status, report.step) == (RunStatus.SUSPENDED, 2)
    assert [e.step for e in report.events if e.kind == "checkpoint"] == [2]
    assert [e.kind for e in report.events][-2:] == ["checkpoint", "suspended"]
    assert [i.step for i in CheckpointStore(tmp_path).list("job-1")] == [2]
    again = job(tmp_path, [(0, 1), (1, 4)], steps=5, attempt=2)
    second = Trainer(again, LocalGroup)
    assert second.run() is RunStatus.SUCCEEDED
    resumed = second.report(0)
    assert [e.data["step"] for e in resumed.events if e.kind == "resumed"] == [2]
    assert [m.step for m in resumed.metrics] == [3, 4, 5]
    assert_matches_reference(again, [*report.metrics, *resumed.metrics])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"schedule": "zero-bubble"}, r"^ScheduleError: unknown schedule 'zero-bubble'"),
        ({"stages": plans([(0, 1), (2, 4)])}, r"^PlanError: stage block ranges"),
        (
            {
                "model": ModelRef(None, "tests.workers.test_factories:wrong_width_mlp", {}),
                "allowed_factories": ("tests.workers.test_factories",),
            },
            r"^stage 0 failed in forward: RuntimeError: mat1 and mat2 shapes cannot be",
        ),
        (
            {"model": ModelRef(None, "evil.module:fn", {})},
            r"^stage [01] failed in build: FactoryError: factory module 'evil.module' is not",
        ),
    ],
)
def test_failures_end_the_run_with_a_one_line_reason(
    tmp_path: Path, fields: dict[str, Any], reason: str
) -> None:
    trainer = Trainer(job(tmp_path, [(0, 2), (2, 4)], **fields), LocalGroup)
    assert trainer.run() is RunStatus.FAILED
    report = trainer.report(0)
    assert report.status is RunStatus.FAILED and report.error is not None
    assert "\n" not in report.error
    assert re.search(reason, report.error), report.error


@pytest.mark.unit
def test_a_job_runner_trains_from_its_creation_with_no_other_call(tmp_path: Path) -> None:
    """Its creator may die just after creating it (a control plane killed): created and
    never called, it trains the job to the end, once."""
    runner = JobRunner(job(tmp_path, [(0, 4)], steps=3), LocalGroup)
    assert runner.wait(120) is RunStatus.SUCCEEDED, runner.poll(0).error
    assert [m.step for m in runner.poll(0).metrics] == [1, 2, 3]
    runner.cancel()
    assert runner.poll(0).status is RunStatus.SUCCEEDED


@pytest.mark.integration
def test_ray_pipeline_trains_exactly_like_one_process(ray_address: str, tmp_path: Path) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    snap = job(tmp_path, even_ranges(4, 3), stages=plans(even_ranges(4, 3), node))
    snap = replace(snap, micro_batches=4, recompute=True)
    trainer = Trainer(snap, RayGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert_matches_reference(snap, metrics(trainer))


@pytest.mark.integration
def test_ray_replicated_pipeline_trains_like_one_process(ray_address: str, tmp_path: Path) -> None:
    """2 replicas x 2 stages: four StageWorker actors, two gloo groups (one per stage), the
    gradient norm reduced over replica 0's stages and every step clipped."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    snap = job(
        tmp_path,
        [],
        stages=dp_plans([(0, 2), (2, 4)], 2, node),
        replicas=2,
        micro_batches=4,
        replica_micro_batches=(1, 3),
        optimizer=replace(SGD, clip_grad_norm=0.05),
        recompute=True,
    )
    trainer = Trainer(snap, RayGroup)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    report = trainer.report(0)
    assert_matches_reference(snap, report.metrics)
    assert all(t.allreduce_s > 0 for m in report.metrics for t in m.stages)
    assert all(m.grad_norm is not None and m.grad_norm > 0.05 for m in report.metrics)
    # Same fold order in both groups: the Ray run equals the in-process run bitwise.
    local = replace(snap, job_id="job-local", stages=dp_plans([(0, 2), (2, 4)], 2))
    assert Trainer(local, LocalGroup).run() is RunStatus.SUCCEEDED
    ray_states, local_states = final_states(snap), final_states(local)
    for i, state in local_states.items():
        for name, tensor in state["module"].items():
            assert torch.equal(ray_states[i]["module"][name], tensor), (i, name)


@pytest.mark.unit
def test_checkpoints_are_written_while_the_next_steps_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each write waits (5 s at most) until the trainer has finished the next step: with
    the write on the step's path, that never happens."""
    import shoal.workers.pipeline.runner

    snap = job(tmp_path, [(0, 2), (2, 4)], steps=4, checkpoint_every=1, checkpoint_keep=0)
    trainer = Trainer(snap, LocalGroup)
    overlapped: dict[int, bool] = {}
    real = shoal.workers.pipeline.runner.write_checkpoint

    def write_later(store: Any, snapshot: Any, step: int, *args: Any) -> Any:
        deadline = time.monotonic() + 5
        while trainer.report(0).step <= step < snap.steps and time.monotonic() < deadline:
            time.sleep(0.01)
        overlapped[step] = trainer.report(0).step > step
        return real(store, snapshot, step, *args)

    monkeypatch.setattr(shoal.workers.pipeline.runner, "write_checkpoint", write_later)
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    assert overlapped == {1: True, 2: True, 3: True, 4: False}
    report = trainer.report(0)
    written = [e.data["step"] for e in report.events if e.kind == "checkpoint"]
    assert written == [1, 2, 3, 4]  # in order, each once complete
    assert [i.step for i in CheckpointStore(tmp_path).list("job-1")] == [1, 2, 3, 4]
    assert_matches_reference(snap, report.metrics)


@pytest.mark.unit
def test_a_failed_checkpoint_write_fails_the_run_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shoal.workers.pipeline.runner

    def broken(*args: Any) -> Any:
        raise OSError("No space left on device")

    monkeypatch.setattr(shoal.workers.pipeline.runner, "write_checkpoint", broken)
    snap = job(tmp_path, [(0, 2), (2, 4)], steps=4, checkpoint_every=1)
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.FAILED
    assert trainer.report(0).error == "OSError: No space left on device"

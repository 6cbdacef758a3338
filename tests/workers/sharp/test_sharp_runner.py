"""The SHARP executor: several models trained at once on shared devices, shards spilled to
host memory, each model's losses and parameters those of its run alone."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.scheduler.copies import LONGEST_INTERVAL
from shoal.scheduler.devices import Device
from shoal.scheduler.memory import transient_bytes
from shoal.scheduler.sharp import Policy
from shoal.workers.checkpoint_events import write_checkpoint
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.profiler import trace_costs
from shoal.workers.reference import train_reference
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import (
    HostLost,
    InputLost,
    LocalPool,
    PoolFactory,
    RayPool,
    _Local,
)
from shoal.workers.snapshot import (
    DataRef,
    JobSnapshot,
    ModelRef,
    OptimizerConf,
    RunnerReport,
    RunStatus,
)
from tests.workers.runs import final_states, reference

MLP = ModelRef("mlp", None, {"in_features": 16, "hidden": 48, "layers": 5, "out_features": 4})
DATA = DataRef("synthetic-regression", None, {"features": 16, "outputs": 4})


def model(root: Path, job_id: str, **fields: Any) -> JobSnapshot:
    snap = JobSnapshot(
        job_id=job_id,
        attempt=1,
        model=fields.pop("model", MLP),
        data=DATA,
        optimizer=fields.pop("optimizer", OptimizerConf("adam", 0.01)),
        batch_size=16,
        micro_batches=4,
        steps=fields.pop("steps", 4),
        seed=fields.pop("seed", 3),
        schedule="gpipe",
        recompute=True,
        stages=(),
        num_blocks=6,
        checkpoint_root=str(root),
        checkpoint_every=0,
        checkpoint_keep=2,
    )
    snap = replace(snap, **fields)
    costs = trace_costs(snap.model, snap.data, micro_batch_size=4, optimizer=snap.optimizer.name)
    return replace(snap, block_costs=costs, num_blocks=len(costs))


def assert_alone(snap: JobSnapshot, losses: list[float], context: object = None) -> None:
    """The model's losses and final parameters equal its plain single-process run;
    ``context`` is said where they do not (what happened to the run)."""
    ref = reference(snap)
    assert losses == ref.losses, context  # bitwise: the same sums in the same order
    states = final_states(snap)
    for block in ref.blocks:
        for name, expected in block.module.state_dict().items():
            assert torch.equal(states[block.index]["module"][name], expected), (block.index, name)


def budget_for_shards(snap: JobSnapshot, shards: int) -> int:
    """A device budget under which the model needs about ``shards`` shards."""
    costs = snap.block_costs
    total = sum(c.param_bytes * 2 + c.optim_bytes for c in costs)
    kept = max(c.activation_bytes_per_sample for c in costs) * 8
    return 2 * (total // shards + kept + max(transient_bytes(c, 8) for c in costs))


def devices(node: str = "n0000000a") -> list[Device]:
    return [Device(f"{node[:8]}-cpu-{i}", node, i, "cpu", 2048, False) for i in range(2)]


def train(
    snaps: list[JobSnapshot],
    make_pool: PoolFactory,
    budget: int,
    node: str = "n0000000a",
    **options: Any,
) -> SharpTrainer:
    pool = devices(node)
    trainer = SharpTrainer(snaps, pool, make_pool, budgets={d.id: budget for d in pool}, **options)
    statuses = trainer.run()
    errors = {s.job_id: trainer.report(s.job_id, 0).error for s in snaps}
    assert statuses == {s.job_id: RunStatus.SUCCEEDED for s in snaps}, errors
    return trainer


@pytest.mark.unit
@pytest.mark.parametrize("policy", list(Policy))
def test_models_larger_than_a_device_train_together_exactly_as_alone(
    tmp_path: Path, policy: Policy
) -> None:
    snaps = [
        model(tmp_path, "a"),
        # b keeps its autograd graph between a shard's forward and backward; a and c
        # recompute the forward from the shard's input.
        model(
            tmp_path, "b", seed=9, steps=6, optimizer=OptimizerConf("sgd", 0.05), recompute=False
        ),
        model(tmp_path, "c", seed=5, steps=3),
    ]
    budget = budget_for_shards(snaps[0], 3)
    trainer = train(snaps, LocalPool, budget, policy=policy)
    for snap in snaps:
        report = trainer.report(snap.job_id, 0)
        (placement,) = [e for e in report.events if e.kind == "placement"]
        assert len(placement.data["stages"]) >= 2  # it does not fit one device
        assert [m.step for m in report.metrics] == list(range(1, snap.steps + 1))
        assert_alone(snap, [m.loss for m in report.metrics])


@pytest.mark.unit
def test_prefetch_moves_the_same_bytes_earlier_and_a_resumed_model_goes_on_exactly(
    tmp_path: Path,
) -> None:
    first = [model(tmp_path, "a", steps=2, checkpoint_every=1)]
    budget = budget_for_shards(first[0], 3)
    train(first, LocalPool, budget, prefetch=False)
    again = [model(tmp_path, "a", steps=5, attempt=2)]
    trainer = train(again, LocalPool, budget)
    report = trainer.report("a", 0)
    assert [e.data["step"] for e in report.events if e.kind == "resumed"] == [2]
    assert [m.step for m in report.metrics] == [3, 4, 5]
    ref = train_reference(
        MLP, DATA, OptimizerConf("adam", 0.01), batch_size=16, micro_batches=4, steps=5, seed=3
    )
    assert [m.loss for m in report.metrics] == ref.losses[2:]


class QueueWatchingPool(LocalPool):
    """A LocalPool that notes, at each run of shard tasks it is given, how many runs its
    device had not finished yet and how long it is, and which tasks took their inputs from
    the device's stash."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.depths: list[int] = []
        self.lengths: list[int] = []
        self.stashed = 0
        self.kept = 0
        self._runs: list[list[Any]] = []

    def submit_run(self, host: int, tasks: Any) -> list[Any]:
        from shoal.workers.sharp.shard_types import Stashed

        unfinished = [r for r in self._runs if r[0].host == host and not r[-1].future.done()]
        self.depths.append(len(unfinished) + 1)
        self.lengths.append(len(tasks))
        self.stashed += sum(isinstance(args[1], Stashed) for _, args in tasks)
        self.kept += sum(args[-2] is not None for _, args in tasks)  # (..., keep, record)
        self._runs.append(super().submit_run(host, tasks))
        return self._runs[-1]


@pytest.mark.unit
@pytest.mark.parametrize("copied", [False, True], ids=["plain", "task-copied"])
def test_each_device_has_its_next_run_of_tasks_queued_behind_the_one_it_runs(
    tmp_path: Path, copied: bool
) -> None:
    """A device is given its next call while it runs one (never more than the two), so it
    goes on without waiting for the executor; a call is a run of a model's tasks whose
    shards live there, up to its step's end (one call's cost, not one per task), but a
    call per task where the tasks copy the step off (copies every step: each task's record
    must come back as it ends); the math stays that of each model alone."""
    copies = {"keep_copies": True, "copy_budget": 1.0} if copied else {}
    snaps = [
        model(tmp_path, "a", steps=3, **copies),
        model(tmp_path, "b", seed=9, steps=3, **copies),
    ]
    pools: list[QueueWatchingPool] = []

    def watched(devs: Any, budgets: Any) -> QueueWatchingPool:
        pools.append(QueueWatchingPool(devs, budgets))
        return pools[-1]

    (device, _) = devices()  # both models live there: each one's run queues behind the other's
    budget = budget_for_shards(snaps[0], 3)
    trainer = SharpTrainer(snaps, [device], watched, budgets={device.id: budget})
    assert trainer.run() == {s.job_id: RunStatus.SUCCEEDED for s in snaps}
    (pool,) = pools
    assert max(pool.depths) == 2, pool.depths
    shards = [
        len(e.data["stages"])
        for s in snaps
        for e in trainer.report(s.job_id, 0).events
        if e.kind == "placement"
    ]
    if copied:
        assert set(pool.lengths) == {1}, pool.lengths
        assert len(pool.lengths) == 3 * sum(2 * k for k in shards)  # one per task
    else:  # a model's shards all live on the device: a run is a step
        assert sorted(set(pool.lengths)) == sorted({2 * k for k in shards}), (
            pool.lengths,
            shards,
        )
        assert len(pool.lengths) == 3 * len(snaps)  # one call per step and model
    for snap in snaps:
        assert_alone(snap, [m.loss for m in trainer.report(snap.job_id, 0).metrics])


@pytest.mark.unit
def test_a_task_whose_next_runs_on_the_same_device_leaves_its_outputs_there(
    tmp_path: Path,
) -> None:
    """On one device every shard's outputs feed the next shard there: each is kept in the
    device's stash (never serialized) and taken by the next task, and the models train
    exactly as alone."""
    snaps = [
        model(tmp_path, "a", steps=3),
        model(tmp_path, "b", seed=9, steps=3, recompute=False),
    ]
    pools: list[QueueWatchingPool] = []

    def watched(devs: Any, budgets: Any) -> QueueWatchingPool:
        pools.append(QueueWatchingPool(devs, budgets))
        return pools[-1]

    (device, _) = devices()
    budget = budget_for_shards(snaps[0], 3)
    trainer = SharpTrainer(snaps, [device], watched, budgets={device.id: budget})
    assert trainer.run() == {s.job_id: RunStatus.SUCCEEDED for s in snaps}
    (pool,) = pools
    shards = [
        len(e.data["stages"])
        for s in snaps
        for e in trainer.report(s.job_id, 0).events
        if e.kind == "placement"
    ]
    # Per step, each shard but the last passes its activations on, each but the first
    # its gradients back: 2 (k - 1) tasks a step hand on, all through the stash.
    handed = sum(2 * (k - 1) * 3 for k in shards)
    assert min(shards) >= 2 and pool.kept == pool.stashed == handed
    for snap in snaps:
        assert_alone(snap, [m.loss for m in trainer.report(snap.job_id, 0).metrics])


@pytest.mark.integration
def test_ray_shard_workers_train_models_together_exactly(ray_address: str, tmp_path: Path) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    snaps = [model(tmp_path, "a", steps=3), model(tmp_path, "b", seed=9, steps=3)]
    trainer = train(snaps, RayPool, budget_for_shards(snaps[0], 2), node)
    for snap in snaps:
        assert_alone(snap, [m.loss for m in trainer.report(snap.job_id, 0).metrics])


@pytest.mark.unit
def test_a_host_keeps_within_its_budget_and_a_shard_run_again_stays(tmp_path: Path) -> None:
    from shoal.workers.pipeline.stage_types import StageSetup
    from shoal.workers.sharp.shard_host import BudgetError, ShardHost
    from shoal.workers.wire import send
    from shoal.workers.zoo.data import make_data

    snap = model(tmp_path, "a")
    data = make_data(snap.data, snap.seed)
    setup = StageSetup.of(snap, data.meta)
    host = ShardHost(devices()[0], budget_bytes=0)
    sizes = [host.add(("a", i), setup, (i, i + 1), 0) for i in range(3)]
    batch = data.batch(0, 4)[0]
    x = [send(batch)]
    # Two shards at a time, and room for what a demoted one keeps for its backward (with
    # the job's recompute, its micro-batch's input).
    kept = batch.numel() * batch.element_size()
    host.budget_bytes = max(sizes[0] + sizes[1], sizes[1] + sizes[2]) + kept
    outputs, first = host.forward(("a", 0), x, prefetch=("a", 1))
    assert first.promoted_bytes == sizes[0] + sizes[1]
    outputs, again = host.forward(("a", 1), outputs)  # prefetched: nothing to copy
    assert again.promoted_bytes == 0 and host.held()["resident"] == [("a", 0), ("a", 1)]
    host.forward(("a", 2), outputs)  # the least recently used one makes room
    assert host.held()["resident"] == [("a", 1), ("a", 2)]
    assert host.held()["resident_bytes"] <= host.budget_bytes
    host.budget_bytes = sizes[0] - 1
    with pytest.raises(BudgetError, match="more than n0000000-cpu-0's budget"):
        host.forward(("a", 0), x)


@pytest.mark.unit
def test_a_host_keeps_its_budget_within_what_the_device_has_beside_its_overhead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shard worker measures what its device holds for it before any shard (on a GPU:
    the CUDA context, libraries); a budget planned with a smaller overhead shrinks to fit."""
    from shoal.workers.device_memory import Overhead
    from shoal.workers.sharp import shard_host

    device = replace(devices()[0], memory_mb=1024)
    assert shard_host.ShardHost(device, 800 * 2**20).held()["overhead_bytes"] == 0  # a CPU
    monkeypatch.setattr(shard_host, "measure_overhead", lambda _: Overhead(600 * 2**20, "process"))
    held = shard_host.ShardHost(device, 800 * 2**20).held()
    assert (held["budget_bytes"], held["overhead_bytes"]) == (424 * 2**20, 600 * 2**20)
    assert shard_host.ShardHost(device, 300 * 2**20).budget_bytes == 300 * 2**20


@pytest.mark.unit
def test_the_first_model_placed_reports_what_each_device_holds_and_how_fast_it_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As a pipeline job's runner does (``device_memory`` and ``device_speed`` events, which
    the control plane keeps with the device): once per device of the executor, by the first
    model placed, whichever device it lives on; a CPU device holds nothing to report."""
    from shoal.workers.device_memory import Overhead
    from shoal.workers.sharp import shard_host

    def device_events(trainer: SharpTrainer, snaps: list[JobSnapshot], kind: str) -> list[Any]:
        reports = {s.job_id: trainer.report(s.job_id, 0) for s in snaps}
        return [(job, e.data) for job, r in reports.items() for e in r.events if e.kind == kind]

    first, second = devices()
    cpu = [model(tmp_path / "cpu", "a", steps=1)]
    trainer = train(cpu, LocalPool, budget_for_shards(cpu[0], 2))
    assert device_events(trainer, cpu, "device_memory") == []
    speeds = device_events(trainer, cpu, "device_speed")
    assert sorted((job, data["device_id"]) for job, data in speeds) == [
        ("a", first.id),
        ("a", second.id),  # no shard of a lives there: measured all the same
    ], speeds
    assert all(data["gflops"] > 0 for _, data in speeds), speeds
    measured = Overhead(64 * 2**20, "process")
    monkeypatch.setattr(shard_host, "measure_overhead", lambda _: measured)
    snaps = [model(tmp_path, name, seed=i, steps=1) for i, name in enumerate("abc")]
    trainer = train(snaps, LocalPool, budget_for_shards(snaps[0], 2))
    events = device_events(trainer, snaps, "device_memory")
    assert sorted((data["device_id"], job) for job, data in events) == [
        (first.id, "a"),
        (second.id, "a"),
    ], events
    assert {(data["overhead_bytes"], data["how"]) for _, data in events} == {
        (measured.bytes, "process")
    }, events
    assert len(device_events(trainer, snaps, "device_speed")) == 2


@pytest.mark.unit
def test_a_host_keeps_room_for_what_a_resident_shards_tasks_were_planned_to_need(
    tmp_path: Path,
) -> None:
    """Two shards whose states fit the budget together, but not what the plan gives each
    (its activations and a backward's temporaries besides): one is demoted for the other."""
    from shoal.workers.pipeline.stage_types import StageSetup
    from shoal.workers.sharp.shard_host import ShardHost
    from shoal.workers.wire import send
    from shoal.workers.zoo.data import make_data

    snap = model(tmp_path, "a")
    data = make_data(snap.data, snap.seed)
    setup = StageSetup.of(snap, data.meta)
    host = ShardHost(devices()[0], budget_bytes=0)
    states = [host.add(("s", i), setup, (i, i + 1), 0) for i in range(2)]
    host.budget_bytes = 2 * max(states)  # both states fit
    planned = [host.add(("a", i), setup, (i, i + 1), host.budget_bytes // 2 + 1) for i in range(2)]
    assert planned == [host.budget_bytes // 2 + 1] * 2
    x = [send(data.batch(0, 4)[0])]
    outputs, first = host.forward(("a", 0), x, prefetch=("a", 1))
    assert first.promoted_bytes == states[0]  # the state is copied; no room for the prefetch
    host.forward(("a", 1), outputs)
    assert host.held()["resident"] == [("a", 1)], host.held()


@pytest.mark.unit
@pytest.mark.parametrize("recompute", [False, True])
def test_a_shard_demoted_between_its_forward_and_backward_leaves_its_kept_tensors_counted(
    tmp_path: Path, recompute: bool
) -> None:
    """A shard's kept micro-batch inputs (and, without recompute, outputs) stay where they
    were made when it is demoted before its backward: the host counts them against its
    budget, so a prefetch that would fit beside the resident shards alone waits."""
    from shoal.workers.pipeline.stage_types import StageSetup
    from shoal.workers.sharp.shard_host import ShardHost
    from shoal.workers.wire import send
    from shoal.workers.zoo.data import make_data

    snap = model(tmp_path, "a", recompute=recompute)
    data = make_data(snap.data, snap.seed)
    setup = StageSetup.of(snap, data.meta)
    host = ShardHost(devices()[0], budget_bytes=2**40)
    planned = 2**24  # each shard's planned need, far above its state
    for i in range(3):
        host.add(("a", i), setup, (i, i + 1), planned)
    x = data.batch(0, 4)[0]
    out, _ = host.forward(("a", 0), [send(x)])
    kept = x.numel() * x.element_size() + (0 if recompute else out[0].nbytes)
    host.budget_bytes = 2 * planned + kept - 1  # two shards, but not two and the residue
    host.forward(("a", 1), out, prefetch=("a", 2))
    held = host.held()
    assert held["resident"] == [("a", 1)] and held["residue_bytes"] == kept, held


@pytest.mark.unit
def test_a_running_pool_takes_new_models_cancels_others_and_ends_when_closed(
    tmp_path: Path,
) -> None:
    """A sweep's pool: trials arrive while others train, a pruned one is cancelled, and
    the pool ends once closed and empty. The trials that ran to the end are exact."""

    from shoal.workers.sharp.sweep_executor import SweepExecutor

    pool = devices()
    runner = SweepExecutor([replace(d, memory_mb=1) for d in pool], LocalPool)
    first = model(tmp_path, "a", steps=30)
    runner.add(first)
    while runner.poll("a", 0).step < 2:
        runner.wait(0.01)
    second = model(tmp_path, "b", seed=9, steps=4)
    runner.add(second)
    runner.cancel("a")
    runner.close()
    assert runner.wait(120), "the executor did not end once closed and empty"
    stopped, done = runner.poll("a", 0), runner.poll("b", 0)
    assert stopped.status is RunStatus.CANCELLED and 2 <= stopped.step < 30
    assert done.status is RunStatus.SUCCEEDED and done.step == 4
    assert_alone(second, [m.loss for m in done.metrics])


@pytest.mark.unit
def test_a_suspended_model_checkpoints_its_step_and_resumes_elsewhere_replaying_nothing(
    tmp_path: Path,
) -> None:
    """A sweep leaving its devices: the model ends SUSPENDED at its next step boundary
    with a checkpoint of that step (and only there: the checkpoints of earlier steps,
    written meanwhile, end nothing), the other models train on, and on another executor it
    resumes there and ends exact."""

    from shoal.workers.sharp.sweep_executor import SweepExecutor

    runner = SweepExecutor(devices(), LocalPool)
    moving = model(tmp_path, "a", steps=30, checkpoint_every=1)
    staying = model(tmp_path, "b", seed=9, steps=12)
    runner.add(moving)
    runner.add(staying)
    while runner.poll("a", 0).step < 2:
        runner.wait(0.01)
    runner.suspend("a")
    runner.close()
    assert runner.wait(120), "the executor did not end once closed and empty"
    suspended = runner.poll("a", 0)
    assert suspended.status is RunStatus.SUSPENDED and 2 <= suspended.step < 30
    said = [e.step for e in suspended.events if e.kind == "suspended"]
    checkpoints = [e.step for e in suspended.events if e.kind == "checkpoint"]
    assert said == [suspended.step] == checkpoints[-1:] == [suspended.metrics[-1].step]
    assert runner.poll("b", 0).status is RunStatus.SUCCEEDED
    assert_alone(staying, [m.loss for m in runner.poll("b", 0).metrics])

    elsewhere = train([replace(moving, attempt=2)], LocalPool, 2**40, node="n0000000b")
    resumed = elsewhere.report("a", 0)
    assert [e.data["step"] for e in resumed.events if e.kind == "resumed"] == [suspended.step]
    losses = [m.loss for m in (*suspended.metrics, *resumed.metrics)]
    assert [m.step for m in resumed.metrics] == list(range(suspended.step + 1, 31))
    assert_alone(moving, losses)


def moves_to_the_idle_device(tmp_path: Path, make_pool: PoolFactory, node: str) -> None:
    """Without trades (models placed as alike, moving at step boundaries): a and c live on
    the first device, b on the other; b is cancelled before it trains: at its first step
    boundary one of a and c moves whole to the device left idle (its state loaded there,
    nothing replayed), and both still train exactly as alone."""
    snaps = [model(tmp_path, name, seed=i, steps=4) for i, name in enumerate("abc")]
    pool = devices(node)
    budget = budget_for_shards(snaps[0], 3)
    budgets = {d.id: budget for d in pool}
    trainer = SharpTrainer(snaps, pool, make_pool, budgets=budgets, trades=False)
    trainer.cancel("b")
    statuses = trainer.run()
    assert statuses == {
        "a": RunStatus.SUCCEEDED,
        "b": RunStatus.CANCELLED,
        "c": RunStatus.SUCCEEDED,
    }
    moves = [
        (name, e) for name in "ac" for e in trainer.report(name, 0).events if e.kind == "relayout"
    ]
    assert len(moves) == 1, moves
    _, move = moves[0]
    assert (move.data["removed"], move.data["added"]) == ([pool[0].id], [pool[1].id])
    assert {row["device_id"] for row in move.data["to"]} == {pool[1].id}
    for snap in (snaps[0], snaps[2]):
        report = trainer.report(snap.job_id, 0)
        assert [m.step for m in report.metrics] == [1, 2, 3, 4]  # nothing replayed
        assert_alone(snap, [m.loss for m in report.metrics])


@pytest.mark.unit
def test_a_model_moves_at_a_step_boundary_to_a_device_no_model_lives_on(tmp_path: Path) -> None:
    moves_to_the_idle_device(tmp_path, LocalPool, "n0000000a")


@pytest.mark.integration
def test_a_model_moves_between_ray_shard_workers(ray_address: str, tmp_path: Path) -> None:
    """The same, its state going from one ShardWorker actor to the other through Ray."""
    import ray

    moves_to_the_idle_device(tmp_path, RayPool, ray.get_runtime_context().get_node_id())


class MoveLosingPool(LocalPool):
    """A LocalPool that loses a device as model a or c moves whole from device 0 to device
    1 (``moves_to_the_idle_device``'s setting): device ``lose`` fails the move's first call
    there (1: the first of their shards added there; 0: the first dropped) and every later
    one."""

    lose = 1

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.gone = False

    def submit(self, host: int, method: str, *args: Any) -> Any:
        moving = method == ("add" if self.lose == 1 else "drop") and args[0][0] in "ac"
        self.gone = self.gone or (host == self.lose and moving)
        if host != self.lose or not self.gone:
            return super().submit(host, method, *args)
        return lost_call(self, host, method)


class HomeLosingPool(MoveLosingPool):
    lose = 0


@pytest.mark.unit
@pytest.mark.parametrize("make_pool", [MoveLosingPool, HomeLosingPool])
def test_a_device_lost_as_a_model_moves_rolls_it_back_exactly(
    tmp_path: Path, make_pool: PoolFactory
) -> None:
    """The device a model moves to, or the one it leaves, is lost halfway through the move
    (some of its shards dropped at home, none or some added there): it rolls back from its
    copy to the device left, and every model still trains exactly as alone. (Moves at step
    boundaries, without trades: ``test_trading`` loses devices as models trade.)"""
    snaps = [
        model(tmp_path, name, seed=i, steps=4, keep_copies=True, copy_budget=1.0)
        for i, name in enumerate("abc")
    ]
    pool = devices()
    budgets = {d.id: budget_for_shards(snaps[0], 3) for d in pool}
    trainer = SharpTrainer(snaps, pool, make_pool, budgets=budgets, trades=False)
    trainer.cancel("b")
    statuses = trainer.run()
    errors = {s.job_id: trainer.report(s.job_id, 0).error for s in snaps}
    assert statuses == {
        "a": RunStatus.SUCCEEDED,
        "b": RunStatus.CANCELLED,
        "c": RunStatus.SUCCEEDED,
    }, errors
    dead = pool[make_pool.lose].id  # type: ignore[attr-defined]
    lost = [e for n in "ac" for e in trainer.report(n, 0).events if e.kind == "device_lost"]
    assert lost and all(e.data["devices"] == [dead] for e in lost), lost
    for snap in (snaps[0], snaps[2]):
        report = trainer.report(snap.job_id, 0)
        latest = {m.step: m.loss for m in report.metrics}  # a replayed step's record replaces it
        assert sorted(latest) == [1, 2, 3, 4]
        assert_alone(snap, [latest[s] for s in range(1, 5)])


@pytest.mark.unit
def test_cancelling_a_model_that_has_ended_changes_nothing(tmp_path: Path) -> None:
    """A pruning decision may arrive after the trial's last step, while others train."""

    from shoal.workers.sharp.sweep_executor import SweepExecutor

    runner = SweepExecutor(devices(), LocalPool)
    runner.add(model(tmp_path, "a", steps=2))
    runner.add(model(tmp_path, "b", seed=9, steps=40))
    while runner.poll("a", 0).status is RunStatus.RUNNING:
        runner.wait(0.01)
    runner.cancel("a")
    runner.close()
    assert runner.wait(120), "the executor did not end once closed and empty"
    assert runner.poll("a", 0).status is RunStatus.SUCCEEDED
    assert runner.poll("b", 0).status is RunStatus.SUCCEEDED, runner.poll("b", 0).error


@pytest.mark.unit
@pytest.mark.parametrize("every", [2, 0])  # a checkpoint along the way, or the last one
def test_a_checkpoint_that_cannot_be_written_fails_its_model_only(
    tmp_path: Path, every: int
) -> None:
    (tmp_path / "not-a-directory").write_text("")
    broken = model(tmp_path / "not-a-directory", "a", checkpoint_every=every)
    fine = model(tmp_path, "b", seed=9, steps=6)
    pool = devices()
    budget = budget_for_shards(fine, 3)
    trainer = SharpTrainer([broken, fine], pool, LocalPool, budgets={d.id: budget for d in pool})
    statuses = trainer.run()
    assert statuses == {"a": RunStatus.FAILED, "b": RunStatus.SUCCEEDED}
    failed = trainer.report("a", 0)
    step = every or broken.steps
    assert f"its checkpoint of step {step} could not be written" in (failed.error or "")
    assert step <= failed.step <= broken.steps
    assert_alone(fine, [m.loss for m in trainer.report("b", 0).metrics])


def placed_first(pool: LocalPool, host: int, method: str) -> int | None:
    """The device the first model placed has a shard on (trades place by measured speed),
    once a shard is placed: the one the losing pools lose."""
    target: int | None = getattr(pool, "target", None)
    if target is None and method == "add":
        target = host
    pool.target = target  # type: ignore[attr-defined]
    return target


def failed_call(host: int, method: str, error: Exception) -> Any:
    """A call to ``host`` that has failed with ``error``."""
    failed: Future[Any] = Future()
    failed.set_exception(error)
    return _Local(host, method, failed)


def lost_call(pool: LocalPool, host: int, method: str, why: str = "its node was preempted") -> Any:
    """A call to ``host`` of ``pool`` that failed: its device was lost (``why``)."""
    return failed_call(host, method, HostLost(pool.devices[host].id, why))


class GonePool(LocalPool):
    """A LocalPool whose device ``gone`` is lost once it is set: every call there fails."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.gone: int | None = None

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if host == self.gone:
            return lost_call(self, host, method)
        return super().submit(host, method, *args)

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        if host == self.gone:
            return lost_call(self, host, method)
        return super().submit_after(host, after, method, *args)


class LosingPool(LocalPool):
    """A LocalPool whose device where the first model placed lives is lost at its
    ``lose_at``-th call from then on: it and every later one fail. With ``inputs_there``,
    the next shard task on another device fails too, as if its input had been made on
    the lost one."""

    lose_at = 12
    inputs_there = False
    counted: frozenset[str] | None = None
    """The methods whose calls count towards ``lose_at`` (None: every one)."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.calls = 0
        self.inputs_lost = 0

    def submit(self, host: int, method: str, *args: Any) -> Any:
        target = placed_first(self, host, method)
        if host == target:
            self.calls += self.counted is None or method in self.counted
            if self.calls >= self.lose_at:
                return lost_call(self, host, method)
        elif (
            self.inputs_there
            and self.calls >= self.lose_at
            and not self.inputs_lost
            and method in ("forward", "backward")
        ):
            self.inputs_lost += 1
            return failed_call(host, method, InputLost(self.devices[host].id))
        return super().submit(host, method, *args)


class CopyLosingPool(LocalPool):
    """A LocalPool whose device where the model placed lives is lost as it is asked for a
    shard's state the ``copy_at``-th time (the first copy is taken when the model is placed,
    the k-th after step k - 1; the last step's is its checkpoint's): as the copy after a
    step is taken."""

    copy_at = 3

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.copies: dict[Any, int] = {}
        self.gone = False

    def submit(self, host: int, method: str, *args: Any) -> Any:
        target = placed_first(self, host, method)
        if host == target and method == "copy" and not self.gone:
            self.copies[args[0]] = self.copies.get(args[0], 0) + 1
            self.gone = min(self.copies.values()) >= self.copy_at
        if host != target or not self.gone:
            return super().submit(host, method, *args)
        return lost_call(self, host, method)

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        """A hand-over in the task queue, right after its copy, and lost with the device:
        so each copy is in before the next step ends, and a copy is taken at every step
        boundary (one still on its way when a step ends is not taken then), as this
        pool's count of copies needs."""
        return self.submit(host, method, *args)


class LastCopyLosingPool(CopyLosingPool):
    copy_at = 5  # after the last of 4 steps


class InputLosingPool(LosingPool):
    inputs_there = True


class PlacementLosingPool(LosingPool):
    lose_at = 1  # while the models' shards are being placed
    counted = frozenset({"add"})


class LateLosingPool(LosingPool):
    lose_at = 52  # a few steps in, after a checkpoint


class TaskLosingPool(LocalPool):
    """A LocalPool that loses the device given the ``lose_at``-th shard task, wherever the
    model's shards live and trade: that call and every later one there fail."""

    lose_at = 36  # a task of step 5, for a model of 4 shards (8 tasks a step)

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.tasks = 0
        self.gone: int | None = None

    def submit(self, host: int, method: str, *args: Any) -> Any:
        self.tasks += method in ("forward", "backward")
        if self.gone is None and self.tasks >= self.lose_at:
            self.gone = host
        if host != self.gone:
            return super().submit(host, method, *args)
        return lost_call(self, host, method)


@pytest.mark.unit
def test_a_lost_device_costs_only_the_step_under_way_and_the_math_stays_exact(
    tmp_path: Path,
) -> None:
    """Mid-run one of the two devices is lost with the shards it held: each model with a
    shard there rolls back to its last whole copy (copies may cost the whole step here: one
    at every boundary; the one of the last step may still be under way, so at most that
    step is replayed), its shards move to the device left, and every model still trains
    exactly as alone."""
    snaps = [
        model(tmp_path, "a", steps=6, keep_copies=True, copy_budget=1.0),
        model(tmp_path, "b", seed=9, steps=6, keep_copies=True, copy_budget=1.0),
    ]
    trainer = train(snaps, LosingPool, budget_for_shards(snaps[0], 3))
    (dead,) = trainer.lost_devices()
    hit = 0
    for snap in snaps:
        report = trainer.report(snap.job_id, 0)
        lost = [e for e in report.events if e.kind == "device_lost"]
        if lost:
            hit += 1
            assert lost[0].data["devices"] == [dead]
            assert lost[0].data["steps_replayed"] <= lost[0].data["most_replayed"] == 1
            (back,) = [e for e in report.events if e.kind == "recovered"]
            assert dead not in {row["device_id"] for row in back.data["to"]}
        latest = {m.step: m.loss for m in report.metrics}  # a replayed step's record replaces it
        assert sorted(latest) == list(range(1, 7))
        assert_alone(snap, [latest[s] for s in range(1, 7)])
    assert hit >= 1


@pytest.mark.unit
@pytest.mark.parametrize("task_copies", [False, True])
def test_copies_over_their_budget_are_taken_less_often_and_a_loss_replays_the_steps_since(
    tmp_path: Path, task_copies: bool
) -> None:
    """Any copy is over a budget of 1e-9 of the training time: after the first measured
    one (step 1's) the next is the longest interval away, so a device lost later rolls the
    model back to step 1 and replays the steps since, which are recorded again with the
    same losses: the math stays that of the model alone. With task copies, the tasks stop
    copying too (step 1's copy is measured once its states are in, which may be after
    step 2 began copying: step 2's may be kept too)."""
    snap = model(tmp_path, "a", steps=6, keep_copies=True, copy_budget=1e-9)
    trainer = train([snap], TaskLosingPool, budget_for_shards(snap, 3), task_copies=task_copies)
    report = trainer.report("a", 0)
    assert report.status is RunStatus.SUCCEEDED, report.error
    (cadence,) = [e for e in report.events if e.kind == "copies"]
    assert cadence.step in ((1, 2) if task_copies else (1,)), cadence
    assert cadence.data["interval"] == LONGEST_INTERVAL, cadence
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    resumed = lost.data["resume_step"]
    assert resumed <= (2 if task_copies else 1), lost
    assert lost.data["steps_replayed"] == lost.data["step"] - resumed >= 2  # none copied since
    latest = {m.step: m.loss for m in report.metrics}  # a replayed step's record replaces it
    assert sorted(latest) == list(range(1, 7))
    assert_alone(snap, [latest[s] for s in range(1, 7)])


@pytest.mark.unit
@pytest.mark.parametrize("pool", [InputLosingPool, PlacementLosingPool])
def test_a_lost_input_or_a_device_lost_while_placing_is_survived_exactly(
    tmp_path: Path, pool: type[LosingPool]
) -> None:
    """A task whose input was on the lost device rolls its model back like the device's own
    models; a device lost before a model trained anything costs nothing: its shards are
    built again from the seed on the device left (no copy needed)."""
    snaps = [
        model(tmp_path, "a", steps=4, keep_copies=pool is InputLosingPool, copy_budget=1.0),
        model(tmp_path, "b", seed=9, steps=4, keep_copies=pool is InputLosingPool, copy_budget=1.0),
    ]
    trainer = train(snaps, pool, budget_for_shards(snaps[0], 3))
    for snap in snaps:
        report = trainer.report(snap.job_id, 0)
        assert [m.step for m in report.metrics] == list(range(1, 5))
        assert_alone(snap, [m.loss for m in report.metrics])
        lost = [e for e in report.events if e.kind == "device_lost"]
        assert all(e.data["steps_replayed"] <= 1 for e in lost)
    events = [e for snap in snaps for e in trainer.report(snap.job_id, 0).events]
    lost = [e for e in events if e.kind == "device_lost"]
    assert lost  # it happened
    if pool is InputLosingPool:
        assert any("input" in e.message for e in lost), [e.message for e in lost]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pool", "every", "step", "resumed"),
    [(CopyLosingPool, 0, 2, 1), (LastCopyLosingPool, 0, 4, 3), (CopyLosingPool, 2, 2, 1)],
)
def test_a_device_lost_while_a_step_is_copied_rolls_back_to_the_copy_before(
    tmp_path: Path, pool: type[CopyLosingPool], every: int, step: int, resumed: int
) -> None:
    """A device lost while the hosts copy step 2 (the dispatch went on), or gather it for
    its checkpoint (``every`` 2: the dispatch waits): the model rolls back to the copy of
    step 1 and replays step 2, with the same loss, the event counting it. Lost in the last
    step's checkpoint (taken as a copy is, the step reported first): it rolls back to the
    copy of step 3, replays step 4 and ends with that checkpoint. (Copies may cost the
    whole step here: one at every boundary; taken at the boundaries, not by the tasks:
    ``test_ledger`` has those.)"""
    snap = model(tmp_path, "a", steps=4, keep_copies=True, copy_budget=1.0, checkpoint_every=every)
    trainer = train([snap], pool, budget_for_shards(snap, 3), task_copies=False)
    report = trainer.report("a", 0)
    assert report.status is RunStatus.SUCCEEDED, report.error
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    assert lost.data == {
        "devices": trainer.lost_devices(),
        "step": step,
        "resume_step": resumed,
        "steps_replayed": step - resumed,
        "copy_interval": 1,
        "most_replayed": 1,
    }
    assert [m.step for m in report.metrics] == [*range(1, step + 1), *range(resumed + 1, 5)]
    latest = {m.step: m.loss for m in report.metrics}
    assert_alone(snap, [latest[s] for s in range(1, 5)])


class StepThreeLosingPool(LocalPool):
    """A LocalPool whose device where the model placed lives is lost as step 3's first
    task is queued, with the calls there still ``held`` back."""

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.held: list[Future[Any]] = []
        self.steps_begun = 0
        self.gone = False

    def submit(self, host: int, method: str, *args: Any) -> Any:
        target = placed_first(self, host, method)
        if method == "forward" and args[0][1] == 0:
            self.steps_begun += 1
            if self.steps_begun == 3 and target is not None:
                self.gone = True
                for held in self.held:
                    held.set_exception(HostLost(self.devices[target].id, "preempted"))
        if self.gone and host == target:
            return lost_call(self, host, method)
        return super().submit(host, method, *args)


class LaggingCopyPool(StepThreeLosingPool):
    """A StepThreeLosingPool whose device holds its part of the copy after step 1 back
    until it is lost: step 2 ended while that copy was on its way (so its own was not
    taken)."""

    def submit_after(self, host: int, after: Any, method: str, *args: Any) -> Any:
        if host == placed_first(self, host, method) and method == "copied" and args[1] == 2:
            self.held.append(Future())  # copy 2 of a shard there: the one after step 1
            return _Local(host, method, self.held[-1])
        return super().submit_after(host, after, method, *args)


def back_to_placement(root: Path, make_pool: PoolFactory) -> RunnerReport:
    """Model "a" (4 steps, a copy every step taken by its hosts) trained on ``make_pool``'s
    pool, which loses its device as step 3 begins with no copy kept since placement: it
    rolls back to the copy made at placement, 2 steps replayed, as its event says (past the
    interval of 1), and trains exactly as alone. Its report."""
    snap = model(root, "a", steps=4, keep_copies=True, copy_budget=1.0)
    trainer = train([snap], make_pool, budget_for_shards(snap, 3), task_copies=False)
    report = trainer.report("a", 0)
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    assert lost.data == {
        "devices": trainer.lost_devices(),
        "step": 2,
        "resume_step": 0,
        "steps_replayed": 2,
        "copy_interval": 1,
        "most_replayed": 2,
    }
    latest = {m.step: m.loss for m in report.metrics}
    assert_alone(snap, [latest[s] for s in range(1, 5)])
    return report


@pytest.mark.unit
def test_a_copy_on_its_way_past_the_next_step_bounds_a_loss_by_the_steps_since_the_one_before(
    tmp_path: Path,
) -> None:
    """The copy after step 1 is still on its way when step 2 ends (copies every step): a
    device lost then, with its part of that copy, rolls the model back to the copy made at
    placement, and the event's bound says so."""
    report = back_to_placement(tmp_path, LaggingCopyPool)
    assert [m.step for m in report.metrics] == [1, 2, 1, 2, 3, 4]


def open_trainer(
    snap: JobSnapshot, pool: list[Device], make_pool: PoolFactory
) -> tuple[SharpTrainer, threading.Thread]:
    """A sweep's executor (open for more models) training ``snap``, on a thread."""
    budgets = {d.id: budget_for_shards(snap, 3) for d in pool}
    trainer = SharpTrainer([snap], pool, make_pool, budgets=budgets, keep_open=True)
    thread = threading.Thread(target=trainer.run)
    thread.start()
    return trainer, thread


def ended(trainer: SharpTrainer, thread: threading.Thread, job_id: str) -> RunnerReport:
    while trainer.report(job_id, 0).status is RunStatus.RUNNING:
        thread.join(0.01)
    return trainer.report(job_id, 0)


@pytest.mark.unit
def test_without_copies_a_lost_device_ends_its_models_as_lost_and_a_new_run_resumes_them(
    tmp_path: Path,
) -> None:
    """The model ends LOST, its shards on the device left dropped; the control plane adds
    it again (a sweep's trial requeued) and it resumes from its latest checkpoint there."""
    snap = model(tmp_path, "a", steps=8, checkpoint_every=2)
    pool = devices()
    trainer, thread = open_trainer(snap, pool, LateLosingPool)
    lost = ended(trainer, thread, "a")
    assert lost.status is RunStatus.LOST and "keep_copies is off" in (lost.error or "")
    assert len(lost.lost_devices) == 1 and list(lost.lost_devices) == trainer.lost_devices()
    trainer.add(replace(snap, attempt=2))
    trainer.close()
    thread.join(120)
    again = trainer.report("a", 0)
    assert again.status is RunStatus.SUCCEEDED, again.error
    (resumed,) = [e for e in again.events if e.kind == "resumed"]
    kept = [m for m in lost.metrics if m.step <= resumed.step]
    assert resumed.step >= 2 and [m.step for m in again.metrics] == list(range(resumed.step + 1, 9))
    assert_alone(snap, [m.loss for m in (*kept, *again.metrics)])


class EveryDeviceLosingPool(LocalPool):
    """A LocalPool whose devices are all lost at once, at its ``lose_at``-th call."""

    lose_at = 20

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.calls = 0

    def submit(self, host: int, method: str, *args: Any) -> Any:
        self.calls += 1
        if self.calls < self.lose_at:
            return super().submit(host, method, *args)
        return lost_call(self, host, method, "its node left")


class LateEveryDeviceLosingPool(EveryDeviceLosingPool):
    lose_at = 100  # a few steps in


@pytest.mark.unit
def test_with_every_device_lost_models_end_lost_and_new_ones_too_while_the_executor_waits(
    tmp_path: Path,
) -> None:
    """Nothing is left to train on: each model ends LOST (the control plane requeues it
    and moves the sweep), a model added meanwhile too, and the executor ends when closed."""
    snap = model(tmp_path, "a", steps=30, keep_copies=True)
    trainer, thread = open_trainer(snap, devices(), EveryDeviceLosingPool)
    assert "no device is left" in (ended(trainer, thread, "a").error or "")
    while len(trainer.lost_devices()) < 2:  # the other device goes as the model rolls back
        thread.join(0.01)
    trainer.add(model(tmp_path, "b", seed=9))
    late = ended(trainer, thread, "b")
    assert late.status is RunStatus.LOST and "no device is left" in (late.error or "")
    trainer.close()
    thread.join(60)
    assert not thread.is_alive()


@pytest.mark.unit
def test_a_lost_model_ends_after_the_checkpoints_it_had_under_way_and_reports_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control plane resumes a lost model from the latest checkpoint it was told of:
    a write still under way when the devices went must be in the LOST report."""
    import time

    import shoal.workers.sharp.checkpointing

    def slowly(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.1)
        return write_checkpoint(*args, **kwargs)

    monkeypatch.setattr(shoal.workers.sharp.checkpointing, "write_checkpoint", slowly)
    snap = model(tmp_path, "a", steps=30, keep_copies=True, checkpoint_every=1)
    trainer, thread = open_trainer(snap, devices(), LateEveryDeviceLosingPool)
    lost = ended(trainer, thread, "a")
    trainer.close()
    thread.join(60)
    latest = CheckpointStore(snap.checkpoint_root).restorable("a").info
    assert lost.status is RunStatus.LOST and latest is not None and latest.step >= 2
    assert max((e.step for e in lost.events if e.kind == "checkpoint"), default=0) == latest.step


@pytest.mark.integration
def test_a_killed_ray_shard_worker_is_survived_exactly(ray_address: str, tmp_path: Path) -> None:
    import os
    import signal

    import ray

    node = ray.get_runtime_context().get_node_id()
    pools: list[RayPool] = []

    def make(devs: Any, budgets: Any) -> RayPool:
        pools.append(RayPool(devs, budgets))
        return pools[-1]

    snaps = [model(tmp_path, "a", steps=40, keep_copies=True, copy_budget=1.0)]
    pool_devices = devices(node)
    budget = budget_for_shards(snaps[0], 3)
    budgets = {d.id: budget for d in pool_devices}
    trainer = SharpTrainer(snaps, pool_devices, make, budgets=budgets, task_copies=True)
    thread = threading.Thread(target=trainer.run)
    thread.start()
    while trainer.report("a", 0).step < 3:
        thread.join(0.05)
    pool = pools[0]
    moves = [e for e in trainer.report("a", 0).events if e.kind in ("placement", "relayout")]
    rows = moves[-1].data["stages" if moves[-1].kind == "placement" else "to"]
    home = [d.id for d in pool_devices].index(rows[0]["device_id"])  # where it lives now
    (pid,) = [pool.result(c) for c in pool.wait([pool.submit(home, "pid")], 60)]
    os.kill(pid, signal.SIGKILL)
    thread.join(300)
    report = trainer.report("a", 0)
    assert report.status is RunStatus.SUCCEEDED, report.error
    (lost,) = [e for e in report.events if e.kind == "device_lost"]
    assert lost.data["devices"] == [pool_devices[home].id]
    # Copied at every step, task by task: the model picks up at its next task (lost at a
    # step boundary: at the step's copy, or, a part of it still on its way and lost, at the
    # backward that part is of), replaying no step.
    assert lost.data["steps_replayed"] == 0, lost.data
    assert [m.step for m in report.metrics] == list(range(1, 41))
    said = [(e.kind, e.step, e.message) for e in report.events if e.kind != "copies"]
    assert_alone(snaps[0], [m.loss for m in report.metrics], said)


class BrokenPool(LocalPool):
    """A LocalPool whose waiting breaks: the executor's loop fails."""

    def wait(self, calls: Any, timeout: float) -> Any:
        raise RuntimeError("the pool broke")


@pytest.mark.unit
def test_a_model_added_after_the_executor_failed_fails_with_why_instead_of_waiting(
    tmp_path: Path,
) -> None:
    snap = model(tmp_path, "a", steps=2)
    pool = devices()
    trainer = SharpTrainer(
        [snap], pool, BrokenPool, budgets={d.id: budget_for_shards(snap, 3) for d in pool}
    )
    assert trainer.run() == {"a": RunStatus.FAILED}
    trainer.add(model(tmp_path, "late"))
    late = trainer.report("late", 0)
    assert late.status is RunStatus.FAILED and "the pool broke" in (late.error or "")

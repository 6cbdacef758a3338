"""Where a model's shards live in the SHARP executor: on its arrival, cut into shards for
the smallest device, given homes and restored from its latest checkpoint; moved whole
to another device; after a loss, the shards of lost devices given new homes and every
shard put back to one step, or to the model's last task done."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shoal.scheduler.sharp import ModelPlan, shard_model
from shoal.workers.checkpoint_events import resumed_event
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.sharp.homes import Homes
from shoal.workers.sharp.ledger import Ledger
from shoal.workers.sharp.models import Blocks, ModelRun
from shoal.workers.sharp.shard_pool import Call, HostPool, await_all, giving_up
from shoal.workers.snapshot import JobSnapshot, RunStatus
from shoal.workers.zoo.data import make_data


def arrive(
    snap: JobSnapshot, budget: int, order: int, homes: Homes, *, task_copies: bool
) -> ModelRun:
    """``snap`` as a model of the executor: cut into shards that fit half of ``budget`` (the
    smallest device's), living where ``homes`` places them (heaviest models placed first
    by the caller), at the step of its latest checkpoint, whose block states become its
    ``origin``, its tasks copying its steps off as they go where ``task_copies`` (and its
    copies are due at every step); LOST when no device is left (the control plane places
    it again)."""
    costs = sorted(snap.block_costs, key=lambda c: c.index)
    shards = shard_model(
        costs,
        budget,
        snap.batch_size // snap.micro_batches,
        micro_batches=snap.micro_batches,
        recompute=snap.recompute,
        precision=snap.precision,
    )
    plan = ModelPlan(snap.job_id, shards, snap.steps, order, snap.recompute)
    data = make_data(snap.data, snap.seed, snap.allowed_factories)
    if not homes.live():
        model = ModelRun(snap, plan, data, [0] * len(shards))
        why = "every device of this executor was lost; no device is left"
        model.run.end(RunStatus.LOST, why, tuple(homes.lost(model.homes)))
        return model
    restorable = CheckpointStore(snap.checkpoint_root).restorable(snap.job_id)
    # Its work is counted on its devices last: a model that cannot be made counts nowhere.
    model = ModelRun(snap, plan, data, homes.place(shards, snap.steps), task_copies=task_copies)
    latest = restorable.info
    model.origin = restorable.blocks or None
    if latest is not None or restorable.skipped:
        model.record(resumed_event(restorable))
    if latest is not None:
        model.restart(latest.step)
        model.placed = model.done
        model.run.resumed_at(latest.step)
    model.record(model.placement(homes.devices))
    return model


def rehome(model: ModelRun, homes: Homes, pool: HostPool, blocks: Blocks | None) -> list[Call]:
    """After a loss: ``model``'s shards on lost devices move to the least loaded live ones
    (``Homes.place``), and every shard goes back to its states in ``blocks`` (a step's, or
    None: built from the seed again, as when it was placed), whatever its device holds of
    it (a hand-over to it may have been cut short). The calls that do it."""
    _place_orphans(model, homes)
    return [model.add(pool, model.homes[s.index], s, blocks, again=True) for s in model.plan.shards]


def pick_up(
    model: ModelRun, homes: Homes, pool: HostPool, ledger: Ledger, start: Blocks
) -> list[Call]:
    """After a loss mid-step: as ``rehome``, but every shard goes back to where the model's
    tasks done have left it (``Ledger.handover``, from ``start``: the step's first
    states), so it picks up at its next task. The calls that do it."""
    _place_orphans(model, homes)
    return [
        model.take(
            pool,
            model.homes[s.index],
            s,
            ledger.handover(model.plan, model.done, s, start),
            again=True,
        )
        for s in model.plan.shards
    ]


def _place_orphans(model: ModelRun, homes: Homes) -> None:
    """``model``'s shards on lost devices get homes on the least loaded live ones."""
    orphans = [s for s in model.plan.shards if not homes.alive(model.homes[s.index])]
    for shard, host in zip(orphans, homes.place(orphans, model.snap.steps), strict=True):
        model.homes[shard.index] = host


def move_if_sooner(
    model: ModelRun,
    homes: Homes,
    models: Iterable[ModelRun],
    pool: HostPool,
    step: int,
    blocks: Blocks | None,
    timeout: float,
) -> None:
    """At a step boundary ``model`` moves whole to the live device where that ends the
    two devices' work soonest, if sooner than staying (``Homes.target``): as models end,
    some devices fall idle while others still hold several. Its state (the step's
    gathered ``blocks``, else its copy of this step, else gathered now) is loaded there;
    nothing is replayed. ``HostLost`` if a device is lost before it moved, or as it did
    (``move``)."""
    home, there = model.homes[0], homes.target(model, models)
    if there is None:
        return
    if blocks is None:
        blocks = model.saved_at(step) or gather(model, pool, timeout)
    await_all(pool, move(model, homes, pool, there, blocks), timeout, giving_up(pool))
    model.moved(homes.devices, home, step)


def gather(model: ModelRun, pool: HostPool, timeout: float) -> dict[int, Any]:
    """Every block of ``model`` in its state now, in wire form (what Ray moves and unpickles
    fastest), from its shards (each host answers after the tasks queued there); a device
    none of whose calls ends within ``timeout`` is given up as hung (``giving_up``), the
    gather ending ``HostLost`` as at any loss."""
    blocks: dict[int, Any] = {}
    calls = model.copy_calls(pool, model.step, timeout)
    for states, _, _ in await_all(pool, calls, timeout, giving_up(pool)):
        blocks.update(states)
    return blocks


def move(model: ModelRun, homes: Homes, pool: HostPool, there: int, blocks: Blocks) -> list[Call]:
    """``model`` moves whole to ``there`` with its states in ``blocks`` (its step's): the
    calls that drop its shards at home and add them there. Its shards live there from now
    on, whatever the calls meet: a device lost before they end (either) rolls it back
    there, or, ``there`` lost, to the devices left; never to shards dropped at home."""
    job_id, shards = model.snap.job_id, model.plan.shards
    calls = [
        pool.submit(home, "drop", (job_id, s.index))
        for s, home in zip(shards, model.homes, strict=True)
    ]
    calls += [model.add(pool, there, s, blocks) for s in shards]
    homes.move(model, there)
    return calls

"""Trades of places in the SHARP executor (``workers.sharp.runner``), by the rules the
simulator trades by (``scheduler.simtrades``).

Before a model queues its next task it may go to a faster device holding no model, or
trade places with the model there that has the least work to go
(``scheduler.sharp_homes.trade_target``; a device's speed is its measured one, shared by
the models living there), where that pays for the moves (``trade_pays``: what holding a
shard costs a device per byte, as measured, ``Homes.held``). A trade is made in two
halves: the model coming queues no task from then on; the model leaving queues tasks
where it is until handing the device over loses less work than one more task would
(``hand_over_now``), and then each goes where the other lived. A loss, an end or a stop
of either calls the trade off.

A model goes by handing each of its shards over (``ShardHost.give`` to ``take``), queued
behind its tasks on the device it leaves and ahead of its next on the one it goes to: the
outputs kept for that task go along, and the forwards whose backward is still to come go
as their inputs and RNG states (run again there when the shard keeps graphs), so no device
waits for this loop and the math is the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shoal.scheduler.sharp_homes import Sharing, hand_over_now, trade_pays, trade_target
from shoal.workers.sharp.homes import Homes
from shoal.workers.sharp.models import ModelRun, Task, Trade
from shoal.workers.sharp.shard_pool import Call, HostPool
from shoal.workers.sharp.shard_types import Stashed


class Trading:
    """The executor's trades, and the hand-over calls under way."""

    def __init__(self, homes: Homes) -> None:
        self._homes = homes
        self.calls: dict[Call, ModelRun] = {}
        """Hand-over calls under way (``give``, ``take``), by the model they move."""

    def consider(
        self,
        pool: HostPool,
        models: Mapping[str, ModelRun],
        in_flight: Iterable[Task],
        now: float,
    ) -> None:
        """Before a dispatch: each model that may queue its next task on its device hands
        it over when a trade sends it off, or goes to a faster one where that pays."""
        queued = sorted(in_flight, key=lambda t: t.number)
        for model in list(models.values()):
            at = model.submitted
            if not model.runnable or at >= model.plan.tasks:
                continue
            if not model.can_submit(model.homes[model.plan.shard_at(at).index]):
                continue
            if model.trade is None:
                self._maybe_trade(pool, model, models)
            else:  # it is the one leaving: the one coming queues nothing
                self._maybe_hand_over(pool, model, models[model.trade.partner], queued, now)

    def _maybe_trade(self, pool: HostPool, model: ModelRun, models: Mapping[str, ModelRun]) -> None:
        """``model`` goes to the faster device ``trade_target`` names, at once if no model
        lives there, else in a trade with the one there with the least work to go."""
        living = self._homes.living(models.values())
        home = model.homes[0]
        if model not in living.get(home, ()):
            return  # a loss left its shards apart: it trades once it lives whole again
        rate = self._homes.rate(home, len(living[home]))
        left = model.plan.remaining_s(model.done)
        target = trade_target(left, rate, self._homes.faster(home, living))
        if target is None:
            return
        there, cost = target.place, self._move_s(model)
        staying = self._sharing(home, living, model)
        if not living[there]:
            if trade_pays(left, staying, self._sharing(there, living, model), cost):
                self._hand_over(pool, model, there, "a faster device for it")
            return
        other = min(living[there], key=lambda m: (m.plan.remaining_s(m.done), m.snap.job_id))
        leaving = (other.plan.remaining_s(other.done), self._move_s(other))
        pays = trade_pays(left, staying, self._sharing(there, living, other), cost, leaving)
        if pays and other.trade is None:
            model.trade = Trade(there, other.snap.job_id, coming=True)
            other.trade = Trade(home, model.snap.job_id, coming=False)
            self._homes.promise(there, True)

    def _move_s(self, model: ModelRun) -> float:
        """What moving ``model`` before its next task costs, in reference seconds: holding
        its shards on the device it goes to, and its forwards to run again there."""
        return self._homes.move_s(model) + model.plan.open_forward_s(model.submitted)

    def _sharing(self, host: int, living: Mapping[int, list[ModelRun]], but: ModelRun) -> Sharing:
        """Device ``host`` as ``trade_pays`` reads it, without ``but``."""
        left = tuple(m.plan.remaining_s(m.done) for m in living[host] if m is not but)
        return Sharing(self._homes.speed(host), left)

    def _maybe_hand_over(
        self, pool: HostPool, model: ModelRun, taker: ModelRun, queued: list[Task], now: float
    ) -> None:
        """``model``, which a trade sends off its device, hands it over now or after one
        more call there (``ModelRun.next_call``: a run of tasks, or one), whichever loses
        less work (``hand_over_now``), the forwards it would run again at the other device
        counted."""
        assert model.trade is not None
        here, there, plan, at = model.homes[0], model.trade.there, model.plan, model.submitted
        run = model.next_call()
        next_s = sum(plan.task_s(at + i) for i in range(run)) * model.ratio
        ready, busy = _ends_in(taker, queued, now), _ends_in(model, queued, now)
        redo = (plan.open_forward_s(at) * model.ratio, plan.open_forward_s(at + run) * model.ratio)
        speeds = self._homes.speed(here), self._homes.speed(there)
        if hand_over_now(ready, busy, next_s, *speeds, redo):
            model.trade = taker.trade = None
            self._homes.promise(here, False)
            mine = model.snap.job_id
            self._hand_over(pool, model, there, f"traded places with {taker.snap.job_id}")
            self._hand_over(pool, taker, here, f"a faster device for it, traded with {mine}")

    def call_off(self, model: ModelRun, models: Mapping[str, ModelRun]) -> None:
        """The trade ``model`` takes part in, if any, is off (it rolls back or ends)."""
        trade = model.trade
        if trade is None:
            return
        partner = models[trade.partner]
        self._homes.promise(trade.there if trade.coming else model.homes[0], False)
        model.trade = partner.trade = None

    def busy(self) -> set[str]:
        """The models with hand-over calls under way."""
        return {m.snap.job_id for m in self.calls.values()}

    def _hand_over(self, pool: HostPool, model: ModelRun, there: int, why: str) -> None:
        """Queue the calls that move ``model``'s shards to ``there`` (``why``, for its
        event); it lives there from now on and its next task is queued there (behind
        them)."""
        here, snap, plan = model.homes[0], model.snap, model.plan
        at = model.submitted
        owner = plan.shard_at(at).index if isinstance(model.carry, Stashed) else None
        for shard in plan.shards:
            stashed = model.carry.position if shard.index == owner else None
            give = pool.submit(here, "give", (snap.job_id, shard.index), stashed)
            take = model.take(pool, there, shard, pool.outputs(give))
            self.calls[give] = self.calls[take] = model
        self._homes.move(model, there)
        model.left.add(here)
        model.last_host = there
        task = plan.task(at)
        when = f"before {task.op.value} {task.shard} of step {{step}}: {why}"
        model.moved(self._homes.devices, here, task.step, when)


def _ends_in(model: ModelRun, queued: list[Task], now: float) -> float:
    """Seconds until the last of ``model``'s queued tasks ends, as the executor can tell:
    the tasks queued before it on its device, each its reference seconds times its model's
    measured ratio, the first call's (a run of tasks, which end together) counted from
    when it was queued."""
    mine = [t for t in queued if t.model is model]
    if not mine:
        return 0.0
    ahead = [t for t in queued if t.host == mine[-1].host and t.number <= mine[-1].number]
    first = [t for t in ahead if t.run == ahead[0].run]
    took = sum(t.model.plan.task_s(t.position) * t.model.ratio for t in first)
    ends = max(0.0, took - (now - ahead[0].at))
    return ends + sum(t.model.plan.task_s(t.position) * t.model.ratio for t in ahead[len(first) :])

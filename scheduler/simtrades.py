"""Trades of places in the simulated SHARP executor (``scheduler.simsharp``, ``Moves.TRADES``).

Before a model queues a task it may go to a faster device holding no model, or trade
places with the model there with the least work to go (``trade_target``). A trade is
made in two halves: the model coming stops queueing tasks at once; the model leaving
queues tasks where it is until handing the device over loses less work than one more
task would (``hand_over_now``), and then each lives where the other did. A loss of either
before that calls the trade off; a model leaving that ends hands over at once. A shard
moved between its forward and its backward runs its forward again where it goes, from the
micro-batches' inputs, as the executor hands shards over (``SimModel.forward_again``),
unless its backward recomputes the forward anyway (``ModelPlan.recompute``).
"""

from __future__ import annotations

from shoal.scheduler.sharp import ModelId, transfer_s
from shoal.scheduler.sharp_homes import Sharing, hand_over_now, trade_pays, trade_target
from shoal.scheduler.simhomes import Residency
from shoal.scheduler.simresult import Tally
from shoal.scheduler.simstate import SimModel, SimQueue
from shoal.scheduler.types import DeviceId


class Trading:
    """The trading half of the simulated executor; ``scheduler.simsharp._Sharp`` is one."""

    devices: dict[DeviceId, SimQueue]
    models: dict[ModelId, SimModel]
    homes: Residency
    tally: Tally

    def _relocate(self, model: SimModel, there: DeviceId) -> None:
        raise NotImplementedError

    def _refresh(self, model: SimModel, now: float = 0.0) -> None:
        raise NotImplementedError

    def _file(self, model: SimModel, now: float) -> None:
        raise NotImplementedError

    def _maybe_trade(self, model: SimModel, now: float) -> None:
        """Before its next task the model goes to a faster device that holds no model, or
        trades places with the model there that has the least work to go, when it has
        enough more to go itself (``trade_target``) and that pays for the moves: each
        one's state copied over, its forwards run again (``trade_pays``, ``_move_s``).
        Each shard's state follows it when its task runs there (copied in as any task's
        shard is); the traded model's tasks already queued on the faster device run there
        first."""
        plan, home = model.plan, model.homes[0]
        need = max(s.bytes for s in plan.shards)
        rate = self.homes.rate(home)
        left = self.homes.left(plan.model)
        target = trade_target(left, rate, self.homes.faster(rate, need))
        if target is None:
            return
        there = target.place
        cost = _move_s(model, self.devices[there])
        other = self.homes.least(there)
        if other is None:
            if trade_pays(left, self._sharing(home, plan.model), self._sharing(there), cost):
                self._relocate(model, there)
                self.tally.trades += 1
            return
        displaced = self.models[other]
        fits = max(s.bytes for s in displaced.plan.shards) <= self.devices[home].idle.budget_bytes
        moves = (self.homes.left(other), _move_s(displaced, self.devices[home]))
        home_s, there_s = self._sharing(home, plan.model), self._sharing(there, other)
        pays = trade_pays(left, home_s, there_s, cost, moves)
        if fits and pays and displaced.leaving is None and displaced.joining is None:
            model.joining, displaced.leaving = (target.place, other), (home, plan.model)
            self.homes.promise(target.place, True)
            self._refresh(displaced, now)  # it may hand over at once

    def _sharing(self, name: DeviceId, but: ModelId | None = None) -> Sharing:
        """Device ``name`` as ``trade_pays`` reads it, without ``but``."""
        left = tuple(self.homes.left(m) for m in self.homes.residents[name] if m != but)
        return Sharing(self.devices[name].idle.speed, left)

    def _maybe_hand_over(self, model: SimModel, now: float) -> None:
        """A model a trade sends off its device hands it over now or after one more task
        there, whichever loses less work (``hand_over_now``), the forwards it would run
        again at the other device counted."""
        assert model.leaving is not None
        there, other = model.leaving
        here = self.devices[model.homes[0]]
        taker = self.models[other]
        next_s = model.plan.task_s(model.submitted) * model.ratio / here.idle.speed
        speed, partner = here.idle.speed, self.devices[there].idle.speed
        ready, busy = self._ready_at(taker, now) - now, self._ready_at(model, now) - now
        plan, at = model.plan, model.submitted
        redo = (plan.open_forward_s(at) * model.ratio, plan.open_forward_s(at + 1) * model.ratio)
        if hand_over_now(ready, busy, next_s, speed, partner, redo):
            self._hand_over(model)
            self._file(taker, now)

    def _hand_over(self, model: SimModel) -> None:
        """The trade is made: ``model`` lives where its taker lived, the taker here."""
        assert model.leaving is not None
        there, other = model.leaving
        taker = self.models[other]
        here = model.homes[0]
        model.leaving = taker.joining = None
        self.homes.promise(here, False)
        if model.done < model.plan.tasks:
            self._relocate(model, there)
        self._relocate(taker, here)
        self.tally.trades += 1

    def _call_off(self, model: SimModel, now: float) -> None:
        """A trade ``model`` takes part in is off (it rolls back)."""
        for pending in (model.joining, model.leaving):
            if pending is not None:
                partner = self.models[pending[1]]
                promised = model.joining[0] if model.joining else model.homes[0]
                self.homes.promise(promised, False)
                model.joining = model.leaving = partner.joining = partner.leaving = None
                self._file(partner, now)

    def _ready_at(self, model: SimModel, now: float) -> float:
        """When the output of the model's last queued task is there, as the executor would
        estimate it: each task before it on its device takes its reference seconds, times
        its model's measured ratio, over the device's speed (the one running, from when it
        started)."""
        if model.seen >= model.submitted or model.last_device is None:
            return now
        device = self.devices[model.last_device]
        running = [] if device.running is None else [device.running]
        at = now
        for job in [*running, *device.queue]:
            owner = self.models[job.model]
            estimate = owner.plan.task_s(job.position) * owner.ratio / device.idle.speed
            at = job.start_s + job.copy_s if job is device.running else max(at, job.arrive_s)
            at += estimate
            if job.model == model.plan.model and job.position == model.submitted - 1:
                return at
        return at


def _move_s(model: SimModel, device: SimQueue) -> float:
    """What moving ``model`` to ``device`` before its next task costs: its whole state
    copied over the device's host link, and its forwards to run again there."""
    plan = model.plan
    state = sum(s.state_bytes for s in plan.shards)
    return transfer_s(state, device.idle) + plan.open_forward_s(model.submitted)

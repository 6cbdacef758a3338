"""What a lost device costs the SHARP executor's models (``workers.sharp.runner``): every
model with a shard there picks up at its next task where its tasks copy the step off the
devices as they go (``workers.sharp.ledger``: the tasks in flight run again), else rolls
back to its last copy (the steps since, at most the step under way); its shards on lost
devices re-homed on the live ones either way. One whose move or hand-over a loss cut short
does the same, wherever its shards got to."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from shoal.scheduler.copies import most_replayed
from shoal.scheduler.devices import Device
from shoal.workers.sharp.checkpointing import CheckpointThread
from shoal.workers.sharp.homes import Homes
from shoal.workers.sharp.ledger import Ledger
from shoal.workers.sharp.models import Blocks, ModelRun
from shoal.workers.sharp.placing import pick_up, rehome
from shoal.workers.sharp.shard_pool import Call, HostLost, HostPool, InputLost
from shoal.workers.sharp.shard_types import Drawn
from shoal.workers.sharp.shard_worker import ShardFailed
from shoal.workers.sharp.stalls import await_saying
from shoal.workers.sharp.trading import Trading
from shoal.workers.snapshot import RunStatus


class Recovering:
    """The loss-handling half of the executor; ``SharpTrainer`` is one."""

    _devices: list[Device]
    _homes: Homes
    _models: dict[str, ModelRun]
    _trading: Trading
    _writer: CheckpointThread
    _timeout: float

    def _busy_models(self) -> set[str]:
        raise NotImplementedError

    def _drop(self, pool: HostPool, model: ModelRun) -> None:
        raise NotImplementedError

    def _fail(self, pool: HostPool, model: ModelRun, why: str) -> None:
        """``model`` fails alone (``why``): its shards are dropped, the others train on."""
        model.end(RunStatus.FAILED, why)
        self._drop(pool, model)

    def _lost_meanwhile(self, pool: HostPool, model: ModelRun, exc: HostLost) -> None:
        """A device was lost while ``model``'s state was gathered or moved at a step
        boundary: every model with shards there rolls back, and so does ``model`` (a move
        may be half done) unless ``_lose`` passed it by (its last step was trained)."""
        model.lost, host = str(exc), self._homes.host_of(exc.device_id)
        self._lose(pool, host, str(exc))
        if model.lost is not None:
            self._roll_back(pool, model, [host])

    def _handed(self, pool: HostPool, call: Call) -> None:
        """A call handing a shard over to another device ended: a device lost meanwhile
        (the one the model leaves, or the one it goes to) rolls the model back, as a
        failure fails it, once its other calls have ended."""
        model = self._trading.calls.pop(call)
        try:
            value = pool.result(call)
        except ShardFailed as exc:
            if model.lost is None:
                model.end(RunStatus.FAILED, str(exc))
        except (HostLost, InputLost) as exc:  # InputLost: what the device it left was to give
            model.lost = model.lost or str(exc)
            if isinstance(exc, HostLost):
                self._lose(pool, self._homes.host_of(exc.device_id), str(exc))
        else:
            if call.method == "take":
                self._homes.held([value])
        if model.lost is not None and model.snap.job_id not in self._busy_models():
            self._roll_back(pool, model)

    def _lose(self, pool: HostPool, host: int, reason: str) -> None:
        """Device ``host`` is gone with the shards it held: every model with one there rolls
        back to its last copy (now, or once its task in flight elsewhere is done); only the
        work since that step boundary is lost."""
        self._homes.lose(host)
        busy = self._busy_models()
        for model in list(self._models.values()):
            if not model.active or host not in model.homes:
                continue  # ended, or trained all its steps (its shards are dropped)
            model.lost = reason
            if model.snap.job_id not in busy:
                self._roll_back(pool, model)

    def _roll_back(self, pool: HostPool, model: ModelRun, left: Sequence[int] = ()) -> None:
        """Re-form ``model`` after a loss: the shards of lost devices move to the least
        loaded live ones, and every shard goes back to where the model's tasks done left it
        when they copied the step off as they went (``_pick_up``: Hydra's promise, a lost
        device costs the tasks in flight), else to its state of the last copy, the model
        running on from there (the steps since, at most the copies' interval). ``left``:
        a device it was moving from, lost with the shards it had there."""
        self._trading.call_off(model, self._models)
        gone = self._homes.lost([*model.homes, *left, *model.left])
        model.left.clear()
        self._states_in(pool, model)
        ledger, saved, live = model.ledger, model.saved, self._homes.live()
        if ledger and saved and live and ledger.covers(model.plan, model.done, saved):
            self._pick_up(pool, model, ledger, saved[1], gone)  # mid-step, copied task by task
            return
        copying = model.copying
        if copying is not None and copying.ledger is not None and saved and live:
            # Its last step's copy lost a part on its way: that step's tasks from there.
            closing = copying.ledger
            missing = {closing.waiting[call] for call in copying.calls}
            at = closing.reopen(model.plan, copying.blocks, missing, saved)
            if at is not None:
                model.done, model.ledger = at, closing
                self._pick_up(pool, model, closing, saved[1], gone)
                return
        # Back to the copy kept: a later one on its way may have been cut short by the
        # loss, or a later one dropped (``ModelRun.drop_copy``).
        kept = model.saved[0] if model.saved else None
        bound = most_replayed(model.cadence.interval, model.step, kept)
        reason, model.lost, model.copying = model.lost, None, None
        copy: tuple[int, dict[int, Any] | None] | None = model.saved
        if copy is None and model.done == model.placed:  # nothing trained since placement
            copy = (model.step, model.origin)
        if copy is None or not live:
            why = "no copy was kept (keep_copies is off)" if live else "no device is left"
            model.leaving = True
            self._drop(pool, model)  # its shards on the devices left
            # Ended after the checkpoints it has under way: its report then names them all,
            # and the control plane resumes it from the latest.
            self._writer.then(model.run.end, RunStatus.LOST, f"{reason}; {why}", tuple(gone))
            return
        step, blocks = copy
        if not self._reform(pool, model, reason, lambda: rehome(model, self._homes, pool, blocks)):
            return
        replayed = model.step - step
        model.restart(step)
        model.recovered(self._devices, gone, reason or "", step, replayed, bound)

    def _reform(
        self, pool: HostPool, model: ModelRun, reason: str | None, calls: Callable[[], list[Call]]
    ) -> bool:
        """Make the ``calls`` that re-form ``model`` after a loss (``reason``) and wait for
        them; False where they did not: another device went meanwhile (its models roll back
        too), or a worker could not build a shard of it again (``model`` fails)."""
        try:
            await_saying(pool, calls(), model, self._timeout, self._devices)
        except HostLost as exc:
            model.lost = str(exc)
            self._lose(pool, self._homes.host_of(exc.device_id), str(exc))
            return False
        except ShardFailed as exc:
            self._fail(pool, model, f"{reason}; it could not be re-formed: {exc}")
            return False
        return True

    def _states_in(self, pool: HostPool, model: ModelRun) -> None:
        """The stepped shards' states still on their way, in (the step's ledger's, and the
        step before's where its end found them on their way): their copies were started as
        their backwards ended (none of the model's tasks is in flight now), so a live
        device's come, and a lost device's if they had left it (the calls to a worker
        known dead fail at once)."""
        ledger, copying = model.ledger, model.copying
        waiting = list(ledger.waiting) if ledger is not None else []
        if copying is not None and copying.ledger is not None:
            waiting += list(copying.calls)
        for call in waiting:
            try:
                ((states, seconds, finished),) = await_saying(
                    pool, [call], model, self._timeout, self._devices
                )
            except (HostLost, ShardFailed, InputLost):
                continue  # lost, or not made: the model rolls back to its last copy
            if ledger is None or not ledger.arrived(call, states, seconds, finished, time.time()):
                model.took_part(call, states, seconds, finished)

    def _pick_up(
        self, pool: HostPool, model: ModelRun, ledger: Ledger, start: Blocks, gone: list[str]
    ) -> None:
        """``model`` goes on from its task ``done`` of ``ledger``'s step, each shard as the
        tasks before left it (``placing.pick_up``, ``start``: the step's first states): only
        its tasks in flight run again (and, a step's copy lost on its way, that step's tasks
        from the part lost on, and the steps after it)."""
        reason, model.lost, model.copying = model.lost, None, None
        ledger.waiting.clear()  # its tasks in flight run again, and copy their shards anew
        # Its losses compare with the targets of the step it picks up in, which may have
        # ended before the loss, the next one begun.
        model.targets = Drawn(ledger.step, model.snap.micro_batches)
        if not self._reform(
            pool, model, reason, lambda: pick_up(model, self._homes, pool, ledger, start)
        ):
            return
        redone, model.submitted = model.submitted - model.done, model.done
        model.carry = ledger.carry(model.plan, model.done)
        # The steps recorded after the one it picks up in (they took no copy while its copy
        # was coming in) run again whole.
        replayed = max(0, model.step - ledger.step - 1)
        bound = most_replayed(model.cadence.interval, model.step, ledger.step + 1)
        model.recovered(
            self._devices, gone, reason or "", ledger.step, replayed, bound, redone=redone
        )

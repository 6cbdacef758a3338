"""A SHARP executor kept waiting by a device's call says so on the model's events, names the
call and its device, and trains on exactly once the call ends."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from shoal.workers.sharp import stalls
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool
from shoal.workers.snapshot import RunStatus
from tests.workers.sharp.test_sharp_runner import assert_alone, budget_for_shards, devices, model


class HeldPool(LocalPool):
    """A LocalPool whose first ``backward`` on device 0 (where the model lives) waits until
    ``release`` is set."""

    release = threading.Event()

    def __init__(self, devices: Any, budgets: Any) -> None:
        super().__init__(devices, budgets)
        self.held = False

    def _call(self, host: int, method: str, *args: Any) -> Any:
        if host == 0 and method == "backward" and not self.held:
            self.held = True
            assert self.release.wait(timeout=60), "the test never released the call"
        return super()._call(host, method, *args)


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_a_call_that_keeps_the_executor_waiting_is_named_in_a_stalled_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stalls, "STALL_S", 0.2)
    HeldPool.release = threading.Event()
    snap = model(tmp_path, "a", steps=2)
    pool = devices()
    budgets = {d.id: budget_for_shards(snap, 2) for d in pool}
    trainer = SharpTrainer([snap], pool, HeldPool, budgets=budgets, trades=False)
    statuses: dict[str, RunStatus] = {}
    training = threading.Thread(target=lambda: statuses.update(trainer.run()))
    training.start()

    def stalled() -> list[Any]:
        return [e for e in trainer.report("a", 0).events if e.kind == "stalled"]

    try:
        for _ in range(200):
            if stalled() or not training.is_alive():
                break
            training.join(timeout=0.1)
        said = stalled()
        events = [(e.kind, e.message) for e in trainer.report("a", 0).events]
        assert said, f"no stalled event while a backward was held; events: {events}"
    finally:
        HeldPool.release.set()
        training.join(timeout=60)
    first = said[0]
    assert {"method": "backward", "device_id": pool[0].id} in first.data["calls"], first.data
    assert f"backward on {pool[0].id}" in first.message and first.data["waited_s"] >= 0.2
    assert statuses == {"a": RunStatus.SUCCEEDED}, trainer.report("a", 0).error
    assert_alone(snap, [m.loss for m in trainer.report("a", 0).metrics])

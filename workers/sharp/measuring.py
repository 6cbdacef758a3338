"""What each device of the SHARP executor holds for its worker and how fast it computes,
measured by its worker when the first models are placed (before, when models trade places:
the speeds place them, ``workers.sharp.homes``). The first model placed says both in its
events, as a pipeline job's runner does (the control plane plans in the rest of the
device's memory and takes the speed as a CPU device's MFU peak)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.scheduler.devices import Device
from shoal.workers.device_fault import not_started_event, set_aside_event
from shoal.workers.device_memory import Overhead, device_memory_event
from shoal.workers.device_speed import device_speed_event
from shoal.workers.sharp.models import ModelRun
from shoal.workers.sharp.shard_pool import HostPool, PoolTimeout, await_all
from shoal.workers.sharp.shard_worker import DeviceFailed, ShardFailed


class Measurements:
    """Each device's overhead and GFLOP/s, by pool position, and which a model has said."""

    def __init__(self) -> None:
        self._measured: dict[int, tuple[Overhead, float]] = {}
        self._said: set[int] = set()
        self.failed: dict[int, str] = {}
        """Devices set aside or whose worker did not answer, each with why: the executor
        loses them (``Recovering._lose``)."""
        self.not_started: set[int] = set()
        """Of ``failed``, those whose worker did not answer within the task timeout: held
        by something else, or its node silent (``worker_not_started``, not set aside)."""

    def measure(self, pool: HostPool, hosts: Iterable[int], timeout: float) -> dict[int, float]:
        """Measure ``hosts`` not measured yet (a ``HostLost`` if one is gone); the GFLOP/s
        of every device measured so far. One whose worker errs is set aside, one whose
        worker does not answer within ``timeout`` is not started (both ``failed``)."""
        for host in [h for h in hosts if h not in self._measured and h not in self.failed]:
            # One at a time: benchmarks side by side would measure contention. Apart: an
            # answer read only after the benchmark would time it as the round trip.
            try:
                (overhead,) = await_all(pool, [pool.submit(host, "overhead")], timeout)
                (gflops,) = await_all(pool, [pool.submit(host, "measure_speed")], timeout)
            except DeviceFailed as exc:  # as its worker started there, or measured it
                self.failed[host] = exc.reason
            except ShardFailed as exc:
                self.failed[host] = f"its worker failed to measure it ({exc.method}: {exc.reason})"
            except PoolTimeout:
                self.failed[host] = f"its worker did not answer within {timeout:g} s"
                self.not_started.add(host)
                pool.give_up(host, self.failed[host])  # one that answers later holds nothing
            else:
                self._measured[host] = (overhead, gflops)
        return {host: gflops for host, (_, gflops) in self._measured.items()}

    def say(self, model: ModelRun, devices: Sequence[Device]) -> None:
        """``model`` says in events what the devices measured and not said yet hold for
        their workers (on a GPU) and how fast they compute."""
        for host, why in sorted(self.failed.items()):
            if host not in self._said:
                self._said.add(host)
                said = not_started_event if host in self.not_started else set_aside_event
                model.record(said(devices[host].id, why, model.step))
        for host, (overhead, gflops) in sorted(self._measured.items()):
            if host in self._said:
                continue
            self._said.add(host)
            if overhead.how != "none":
                model.record(device_memory_event(devices[host], overhead, model.step))
            model.record(device_speed_event(devices[host], gflops, model.step))

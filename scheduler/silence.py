"""Which of the SHARP executor's devices has stopped answering: none of its calls has ended
for the task timeout while it had calls under way.

The executor waits for every device's calls at once, and any call's end wakes it. A worker
hung in a call (a wedged GPU, a driver call that never returns) while the other devices go
on would hold its models for good: the executor's own timeout fires only when no call of
any device ends. ``Silence`` keeps, for each device with calls under way, when one of them
last ended (or when its calls began, if none has since): a device silent for the timeout is
given up as lost (``HostPool.give_up``), and the usual loss path re-homes its models from
their copies.
"""

from __future__ import annotations

from collections.abc import Iterable


class Silence:
    """When each device with calls under way was last heard from."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0.0:
            raise ValueError(f"the task timeout must be > 0, got {timeout}")
        self.timeout = timeout
        self._since: dict[int, float] = {}

    def heard(self, pending: Iterable[int], ended: Iterable[int], now: float) -> None:
        """At ``now``: a call of each device of ``ended`` has just ended, and the devices of
        ``pending`` have calls under way (the others have none: nothing to wait for)."""
        under_way = set(pending)
        for host in ended:
            self._since[host] = now
        for host in list(self._since):
            if host not in under_way:
                del self._since[host]
        for host in under_way:
            self._since.setdefault(host, now)

    def silent(self, now: float) -> list[int]:
        """The devices with calls under way none of which has ended for the timeout."""
        return sorted(h for h, since in self._since.items() if now - since >= self.timeout)

    def left(self, now: float) -> float:
        """Seconds until the first device goes silent (the timeout when none has calls
        under way; 0 when one already has)."""
        soonest = min(self._since.values(), default=now)
        return max(0.0, soonest + self.timeout - now)

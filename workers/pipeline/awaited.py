"""A call's result handed to another call as something it waits for itself, not as an
argument Ray fetches before the call runs.

A buddy's ``hold`` keeps a worker's ``shipment`` (its in-memory copy); a relayed step's
``forward`` takes the stage before's activation; a ``rollback`` or ``adopt`` takes blocks
other workers export. Given as an argument, the result is fetched by Ray before the call
runs, and nothing stops that wait: when the node it comes from is lost while it is on the
way, the fetch lasts until Ray gives the object up (7.5 s for a copy in a ``shoal bench
elastic`` run; in a throwaway test, a 600 MB object whose node was killed mid-transfer was
still being fetched 120 s later), and every call queued on that thread of the worker waits
behind it: a recovery's fresh copies, or the survey that asks the worker what it holds, a
worker that does not answer it being counted lost too. As an ``Awaited`` the call polls
for it, and gives up as soon as the receiving worker says the wait is moot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayTaskError

POLL_S = 0.05
"""How often a waiting call asks whether it should give up."""


class Moot(RuntimeError):
    """The awaited result is no longer wanted; the message says why."""


class Disconnected(RuntimeError):
    """This process lost its connection to Ray while it waited (``OSError`` from Ray's own
    calls, such as a broken pipe to its raylet): its node is going down, and the awaited
    result can never arrive here."""


class Awaited:
    """Another call's result (its object ref), to wait for inside the receiving call."""

    def __init__(self, ref: ray.ObjectRef[Any]) -> None:
        self.ref = ref

    def result(self, moot: Callable[[], str | None]) -> Any:
        """The result, once it is in this node's object store; the error the call raised
        (Ray's own, such as a lost actor or object, as Ray raised it); or ``Moot`` with
        the reason ``moot`` gives, as soon as it gives one; ``Disconnected`` when Ray
        itself cannot be reached from this process."""
        try:
            while not ray.wait([self.ref], timeout=POLL_S, fetch_local=True)[0]:
                reason = moot()
                if reason is not None:
                    raise Moot(reason)
            return ray.get(self.ref)
        except RayTaskError as exc:  # the call's own error, as if Ray had passed it on
            raise (exc.cause if exc.cause is not None else exc) from None
        except OSError as exc:
            raise Disconnected(f"its worker lost its connection to Ray ({exc})") from None

"""Isolation of the controller's steps: one job's or sweep's error is its own, never the loop's.

The controller runs many steps per tick (follow each job, run each sweep, place, resize,
preempt). A step that fails with a *transient* error (the database or the cluster briefly
unreachable) is retried on the next tick. Any other error is a fault of that step's own
job or sweep: it is ended FAILED with the reason (``on_fault``), and the tick goes on with
everyone else's work, so the loop keeps placing jobs and ``/readyz`` stays ready.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from shoal.service.cluster import ClusterUnavailable, RunnerGone

log = logging.getLogger(__name__)

TRANSIENT: tuple[type[BaseException], ...] = (
    OperationalError,  # a connection lost, a server restarting, SQLite busy
    InterfaceError,
    DisconnectionError,
    PoolTimeout,
    ClusterUnavailable,
    RunnerGone,
)
"""Errors that say nothing about the job or sweep at hand: retried next tick."""


def describe(exc: BaseException) -> str:
    """The reason a unit failed, as its owner reads it in the job's or sweep's error."""
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    kind = type(exc).__name__
    return (
        f"internal error in the controller ({kind}{': ' + first if first else ''}); ended alone"
        " so that other work goes on (the service's log has the trace)"
    )


@contextmanager
def isolated(what: str, on_fault: Callable[[str], None] | None = None) -> Iterator[None]:
    """Run one controller step for ``what`` (``"sweep 1f2e"``, ``"job 9a0c"``, ``"placement"``).

    A transient error is logged and left for the next tick; any other error is logged with
    its trace and handed to ``on_fault`` with the reason (which ends that job or sweep). A
    fault in ``on_fault`` itself is logged too: nothing here escapes to the loop.
    """
    try:
        yield
    except TRANSIENT as exc:
        log.warning("%s: retrying next tick: %s", what, exc)
    except Exception as exc:  # the boundary of one unit's work: its fault must not stop others
        log.exception("%s failed", what)
        if on_fault is None:
            return
        try:
            on_fault(describe(exc))
        except Exception:  # the database may be the cause too: the next tick tries again
            log.exception("%s: could not be ended after its failure", what)

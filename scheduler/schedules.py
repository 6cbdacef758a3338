"""Pipeline schedules as data: per-stage action lists (GPipe, 1F1B), validated and rendered.

A schedule says, for every stage, the order in which it runs the forward (F) and backward (B)
of each micro-batch within one mini-batch. Cross-stage dependencies are implied: F(s, j)
needs F(s-1, j)'s output, B(s, j) needs B(s+1, j)'s input gradient, and the last stage's
B(j) needs its own F(j) (the loss). ``validate`` proves a schedule is complete and
deadlock-free by simulating it in unit time slots; the same simulation gives ``render``'s
grid and the runner's dependency-respecting submission order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias


class Op(StrEnum):
    F = "F"
    B = "B"


@dataclass(frozen=True)
class Action:
    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}"


Schedule: TypeAlias = tuple[tuple[Action, ...], ...]
"""One tuple of actions per stage, in the order that stage runs them."""

Timeline: TypeAlias = tuple[tuple[Action | None, ...], ...]
"""The simulation: one tuple per stage, one cell per time slot (None = idle)."""


class ScheduleError(ValueError):
    """A schedule is incomplete, out of order or deadlocks; the message carries its grid."""


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every forward of the mini-batch, then every backward.

    Simple and bubble-optimal for synchronous training, but stage s holds the activations of
    all ``micro_batches`` at once before the first backward frees any.
    """
    _check_sizes(stages, micro_batches)
    return tuple(
        tuple(Action(s, Op.F, j) for j in range(micro_batches))
        + tuple(Action(s, Op.B, j) for j in range(micro_batches))
        for s in range(stages)
    )


FIRST_STAGE_AHEAD = 1
"""Forwards the first stage of a 1F1B pipeline runs ahead of the plain warm-up
(``one_f_one_b``)."""


def one_f_one_b(stages: int, micro_batches: int, *, ahead: int = FIRST_STAGE_AHEAD) -> Schedule:
    """1F1B with a flush (PipeDream-Flush, Narayanan et al., 2021; DAPPLE's early backward).

    Stage s warms up with ``min(p - s - 1, m)`` forwards, then alternates one forward and one
    backward, then drains the remaining backwards. Same bubble as GPipe, (p-1)/(m+p-1), but at
    most ``p - s`` micro-batches are in flight on stage s instead of ``m``.

    The first stage of a pipeline of two or more warms up with ``ahead`` forwards more
    (``FIRST_STAGE_AHEAD``; 0: the plain schedule): its backwards feed no other stage, so
    running a forward before them delays nobody, and it fills the wait for its first
    gradient with work.
    Where the first stage is the slowest (unequal blocks, a slower device), that wait and
    the one for its last gradient are idle time on the step's critical path: measured on
    the pipeline bench (2 stages, the first 8% the heavier), the first stage was busy
    0.85-0.88 of the step with the plain warm-up and 0.88-0.90 with one forward ahead.
    It holds ``ahead`` more micro-batches in flight.
    """
    _check_sizes(stages, micro_batches)
    schedule = []
    for s in range(stages):
        warmup = _warmup(stages, s, micro_batches, ahead)
        actions = [Action(s, Op.F, j) for j in range(warmup)]
        for j in range(warmup, micro_batches):
            actions += [Action(s, Op.F, j), Action(s, Op.B, j - warmup)]
        actions += [Action(s, Op.B, j) for j in range(micro_batches - warmup, micro_batches)]
        schedule.append(tuple(actions))
    return tuple(schedule)


def peak_in_flight(name: str, stages: int, stage: int, micro_batches: int) -> int:
    """The most micro-batches stage ``stage`` of ``build(name, stages, micro_batches)``
    holds at once (``in_flight`` of its actions), without building it."""
    if name == "gpipe":
        return micro_batches
    return min(micro_batches, _warmup(stages, stage, micro_batches, FIRST_STAGE_AHEAD) + 1)


def _warmup(stages: int, stage: int, micro_batches: int, ahead: int) -> int:
    """The forwards stage ``stage`` of a 1F1B pipeline runs before its first backward."""
    extra = ahead if stage == 0 and stages > 1 else 0
    return min(stages - stage - 1 + extra, micro_batches)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(name: str, stages: int, micro_batches: int) -> Schedule:
    """The named schedule (``gpipe`` or ``1f1b``) for ``stages`` x ``micro_batches``."""
    factory = SCHEDULES.get(name)
    if factory is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return factory(stages, micro_batches)


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(
            f"a schedule needs at least 1 stage and 1 micro-batch, got stages={stages},"
            f" micro_batches={micro_batches}"
        )


def dependencies(action: Action, last_stage: int) -> tuple[Action, ...]:
    """The actions ``action`` needs done first (``last_stage``: the pipeline's last)."""
    s, j = action.stage, action.microbatch
    if action.op is Op.F:
        return (Action(s - 1, Op.F, j),) if s > 0 else ()
    if s == last_stage:
        return (Action(s, Op.F, j),)
    return (Action(s + 1, Op.B, j),)


def simulate(schedule: Schedule) -> tuple[Timeline, tuple[tuple[Action, ...], ...]]:
    """Run the schedule in unit time slots: each stage runs its next action once that action's
    dependencies finished in an earlier slot. Returns the timeline and, per stage, the actions
    that never ran (non-empty only when the schedule deadlocks)."""
    last = len(schedule) - 1
    cursors = [0] * len(schedule)
    done: set[Action] = set()
    rows: list[list[Action | None]] = [[] for _ in schedule]
    while True:
        ready = [
            actions[cursors[s]]
            if cursors[s] < len(actions)
            and all(d in done for d in dependencies(actions[cursors[s]], last))
            else None
            for s, actions in enumerate(schedule)
        ]
        if all(a is None for a in ready):
            break
        for s, action in enumerate(ready):
            rows[s].append(action)
            if action is not None:
                cursors[s] += 1
        done.update(a for a in ready if a is not None)
    stuck = tuple(actions[cursors[s] :] for s, actions in enumerate(schedule))
    return tuple(tuple(r) for r in rows), stuck


def submission_order(schedule: Schedule) -> tuple[Action, ...]:
    """Every action in an order that respects all dependencies (slot by slot, stage by stage).

    Submitting each stage's actions to an in-order executor in this order never waits on an
    action that has not been submitted yet.
    """
    validate(schedule)
    timeline, _ = simulate(schedule)
    slots = len(timeline[0])
    return tuple(a for t in range(slots) for row in timeline if (a := row[t]) is not None)


def in_flight(actions: tuple[Action, ...]) -> int:
    """The most micro-batches one stage holds activations for at once (forward done, backward
    not yet): what bounds its activation memory."""
    live = peak = 0
    for action in actions:
        live += 1 if action.op is Op.F else -1
        peak = max(peak, live)
    return peak


def render(schedule: Schedule) -> str:
    """The schedule as a text grid: one row per stage, one column per time slot.

    Cells are ``F3`` / ``B1`` / ``.`` (idle); actions that never run (deadlock) follow a
    ``|`` with a ``!`` mark.
    """
    if not schedule:
        return "(empty schedule)"
    timeline, stuck = simulate(schedule)
    cells = [
        [str(a) if a is not None else "." for a in row] + (["|"] if any(stuck) else [])
        for row in timeline
    ]
    for s, actions in enumerate(stuck):
        cells[s] += [f"{a}!" for a in actions]
    width = max((len(c) for row in cells for c in row), default=1)
    label = len(f"s{len(schedule) - 1}")
    return "\n".join(
        f"{f's{s}':<{label}} " + " ".join(c.rjust(width) for c in row).rstrip()
        for s, row in enumerate(cells)
    )


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless every (stage, micro-batch) has exactly one F and one B,
    F precedes B on its stage, and the cross-stage simulation runs every action."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage")
    problem = _shape_problem(schedule)
    if problem is None and any(simulate(schedule)[1]):
        problem = "the schedule deadlocks (actions marked ! can never run)"
    if problem is not None:
        raise ScheduleError(f"{problem}\n{render(schedule)}")


def _shape_problem(schedule: Schedule) -> str | None:
    micro_batches = 1 + max((a.microbatch for row in schedule for a in row), default=-1)
    if micro_batches == 0:
        return "the schedule has no actions"
    expected = {(op, j) for op in Op for j in range(micro_batches)}
    for s, actions in enumerate(schedule):
        wrong = [a for a in actions if a.stage != s]
        if wrong:
            return f"stage {s} lists {wrong[0]!r}, an action of another stage"
        seen: dict[tuple[Op, int], int] = {}
        for position, a in enumerate(actions):
            if (a.op, a.microbatch) in seen:
                return f"stage {s} runs {a} twice"
            seen[(a.op, a.microbatch)] = position
        extra = sorted(seen.keys() - expected, key=lambda k: (k[1], k[0].value))
        if extra:
            op, j = extra[0]
            return f"stage {s} runs {op.value}{j}, not a micro-batch index"
        missing = sorted(expected - seen.keys(), key=lambda k: (k[1], k[0].value))
        if missing:
            op, j = missing[0]
            return f"stage {s} never runs {op.value}{j} (micro-batches 0..{micro_batches - 1})"
        for j in range(micro_batches):
            if seen[(Op.B, j)] < seen[(Op.F, j)]:
                return f"stage {s} runs B{j} before F{j}"
    return None

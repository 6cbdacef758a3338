"""Stage-local step programs: what each pipeline stage posts, waits for and runs in one step.

Stages exchange activations and gradients peer to peer (torch.distributed send/recv) instead
of through the runner. Each adjacent pair (s, s+1) is one channel whose ops complete in FIFO
order on each side, the k-th op of one side matched with the k-th of the other (NCCL's
point-to-point semantics), so both sides must post the channel's transfers in the same order.
``stage_programs`` takes that order from the schedule's unit-time simulation (a transfer's
slot is the slot of the action that produced it) and posts receives early where the order
needs it; consecutive posts to one neighbour fuse into one ``batch_isend_irecv`` (Megatron's
``send_forward_recv_backward`` in 1F1B's steady state). ``check_programs`` proves a set of
programs runs to the end in that transport model; ``programs_for`` builds and checks once per
(schedule, stages, micro-batches), so the engine only ever runs checked programs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeAlias

from shoal.scheduler.schedules import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    Timeline,
    build,
    simulate,
    validate,
)


class Flow(StrEnum):
    ACT = "act"  # activation of a micro-batch, from stage s to s+1
    GRAD = "grad"  # gradient w.r.t. stage s+1's input, from stage s+1 to stage s


@dataclass(frozen=True)
class Transfer:
    flow: Flow
    microbatch: int
    send: bool  # True: this stage sends it; False: this stage receives it

    @property
    def peer(self) -> int:
        """Offset of the neighbour: activations go to s+1, gradients to s-1."""
        return 1 if (self.flow is Flow.ACT) == self.send else -1

    def __str__(self) -> str:
        return (
            f"{'S' if self.send else 'R'}{_arrow(self.peer)}{self.flow.value[0]}{self.microbatch}"
        )


@dataclass(frozen=True)
class Post:
    """Post these transfers at once, non-blocking (one batch_isend_irecv), all with one
    neighbour."""

    transfers: tuple[Transfer, ...]

    def __str__(self) -> str:
        return "+".join(str(t) for t in self.transfers)


@dataclass(frozen=True)
class Wait:
    """Block until this received transfer has arrived (the next Run consumes it)."""

    transfer: Transfer

    def __str__(self) -> str:
        return "W" + str(self.transfer)[1:]


@dataclass(frozen=True)
class Run:
    """Run the forward or backward of a micro-batch (an action of the schedule)."""

    action: Action

    def __str__(self) -> str:
        return str(self.action)


Instr: TypeAlias = Post | Wait | Run
Program: TypeAlias = tuple[Instr, ...]


def _arrow(peer: int) -> str:
    return ">" if peer > 0 else "<"


def _input(action: Action, stages: int) -> Transfer | None:
    """The transfer a stage must receive before running ``action`` (None: no peer input)."""
    if action.op is Op.F:
        return Transfer(Flow.ACT, action.microbatch, send=False) if action.stage > 0 else None
    last = action.stage == stages - 1
    return None if last else Transfer(Flow.GRAD, action.microbatch, send=False)


def _output(action: Action, stages: int) -> Transfer | None:
    """The transfer a stage sends after running ``action`` (None: no peer needs it)."""
    if action.op is Op.F:
        last = action.stage == stages - 1
        return None if last else Transfer(Flow.ACT, action.microbatch, send=True)
    return Transfer(Flow.GRAD, action.microbatch, send=True) if action.stage > 0 else None


def _producer(stage: int, transfer: Transfer) -> Action:
    """The action of ``stage`` that produces the tensor it sends as ``transfer``."""
    return Action(stage, Op.F if transfer.flow is Flow.ACT else Op.B, transfer.microbatch)


# ------------------------------------------------------------------------ building


Channel: TypeAlias = tuple[tuple[Flow, int], ...]
"""The transfers of one channel (s, s+1) in the order both sides post them."""


def _channel_orders(schedule: Schedule, timeline: Timeline) -> tuple[Channel, ...]:
    """Per channel, its transfers by the slot of the action that produced them.

    Only F(s, j) (activation) and B(s+1, j) (gradient) produce on channel s, and a stage runs
    one action per slot, so a tie is one of each: the activation goes first on both sides.
    """
    slot = {a: t for row in timeline for t, a in enumerate(row) if a is not None}
    micro_batches = len(schedule[0]) // 2
    orders = []
    for s in range(len(schedule) - 1):
        keyed = [(slot[Action(s, Op.F, j)], 0, Flow.ACT, j) for j in range(micro_batches)]
        keyed += [(slot[Action(s + 1, Op.B, j)], 1, Flow.GRAD, j) for j in range(micro_batches)]
        orders.append(tuple((flow, j) for _, _, flow, j in sorted(keyed)))
    return tuple(orders)


RECEIVES_AHEAD = 2
"""How many receives a stage keeps posted on one channel before it waits for them: the one
it needs next and one more. Gloo moves a send's data only once the receiver has posted the
receive (it tells the sender so), so a receive posted only when it is needed costs a round
trip between the two processes before the data flows; posted one ahead, the data arrives
while the stage computes. Each costs one boundary-sized buffer held early."""


@dataclass
class _Builder:
    """Emits one stage's program, posting each channel's transfers strictly in its order."""

    channels: dict[int, Channel]  # by neighbour offset
    instrs: list[Instr] = field(default_factory=list)
    cursor: dict[int, int] = field(default_factory=lambda: {-1: 0, 1: 0})
    unwaited: dict[int, int] = field(default_factory=lambda: {-1: 0, 1: 0})

    def post_through(self, transfer: Transfer) -> None:
        """Post ``transfer`` and every earlier transfer of its channel not posted yet (the
        receives that the peer's order puts first), then the receives that follow it, up
        to ``RECEIVES_AHEAD`` posted and not yet waited."""
        peer = transfer.peer
        order = self.channels[peer]
        end = order.index((transfer.flow, transfer.microbatch)) + 1
        end = max(end, self.cursor[peer])
        while end < len(order) and self._receives(order[end], peer):
            pending = sum(1 for f, _ in order[self.cursor[peer] : end] if self._receives(f, peer))
            if self.unwaited[peer] + pending >= RECEIVES_AHEAD:
                break
            end += 1
        batch = tuple(
            Transfer(flow, j, send=not self._receives((flow, j), peer))
            for flow, j in order[self.cursor[peer] : end]
        )
        if not batch:
            return
        self.cursor[peer] = end
        self.unwaited[peer] += sum(1 for t in batch if not t.send)
        last = self.instrs[-1] if self.instrs else None
        if isinstance(last, Post) and last.transfers[0].peer == peer:
            self.instrs[-1] = Post(last.transfers + batch)
        else:
            self.instrs.append(Post(batch))

    def wait(self, transfer: Transfer) -> None:
        self.instrs.append(Wait(transfer))
        self.unwaited[transfer.peer] -= 1

    @staticmethod
    def _receives(item: tuple[Flow, int] | Flow, peer: int) -> bool:
        """Whether this stage receives a transfer of the item's flow from ``peer``:
        activations come from below, gradients from above."""
        flow = item if isinstance(item, Flow) else item[0]
        return (flow is Flow.ACT) == (peer < 0)


def stage_programs(schedule: Schedule) -> tuple[Program, ...]:
    """One program per stage, running that stage's actions in exactly the schedule's order."""
    validate(schedule)
    timeline, _ = simulate(schedule)
    orders = _channel_orders(schedule, timeline)
    stages = len(schedule)
    programs = []
    for s, actions in enumerate(schedule):
        channels = {p: orders[s + min(p, 0)] for p in (-1, 1) if 0 <= s + p < stages}
        builder = _Builder(channels)
        for action in actions:
            needed = _input(action, stages)
            if needed is not None:
                builder.post_through(needed)
                builder.wait(needed)
            builder.instrs.append(Run(action))
            produced = _output(action, stages)
            if produced is not None:
                builder.post_through(produced)
        programs.append(tuple(builder.instrs))
    return tuple(programs)


# ------------------------------------------------------------------------ checking


@dataclass
class _Stage:
    """One stage's state in ``check_programs``'s simulation."""

    index: int
    program: Program
    pc: int = 0
    posted: dict[int, list[Transfer]] = field(default_factory=lambda: {-1: [], 1: []})
    position: dict[Transfer, int] = field(default_factory=dict)
    waited: set[Transfer] = field(default_factory=set)
    ran: set[Action] = field(default_factory=set)


class _Simulation:
    """The transport model: Posts never block; a Wait returns once the peer has posted the
    matching op (FIFO per channel, so every earlier op of the channel has matched too); a
    stage finishes once every send it posted is matched."""

    def __init__(self, programs: Sequence[Program]) -> None:
        self.stages = [_Stage(s, tuple(p)) for s, p in enumerate(programs)]

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for stage in self.stages:
                while self._step(stage):
                    progress = True
        stuck = [self._stuck_on(st) for st in self.stages if not self._finished(st)]
        if stuck:
            raise self._error("the programs deadlock:\n  " + "\n  ".join(stuck))
        for st in self.stages:
            unwaited = [t for t in st.position if not t.send and t not in st.waited]
            if unwaited:
                raise self._error(
                    f"s{st.index} posts receive {unwaited[0]} but never waits for it;"
                    " wait for it before the Run that consumes it, or do not post it"
                )

    def _step(self, st: _Stage) -> bool:
        if st.pc == len(st.program):
            return False
        instr = st.program[st.pc]
        if isinstance(instr, Post):
            self._post(st, instr)
        elif isinstance(instr, Wait):
            if not self._arrived(st, instr.transfer):
                return False
            st.waited.add(instr.transfer)
        else:
            self._run(st, instr.action)
        st.pc += 1
        return True

    def _neighbour(self, st: _Stage, peer: int) -> _Stage:
        return self.stages[st.index + peer]

    def _matched(self, st: _Stage, transfer: Transfer) -> bool:
        """Whether the peer has posted the op at ``transfer``'s place on the channel."""
        peer = transfer.peer
        return st.position[transfer] < len(self._neighbour(st, peer).posted[-peer])

    def _finished(self, st: _Stage) -> bool:
        sends = (t for t in st.position if t.send)
        return st.pc == len(st.program) and all(self._matched(st, t) for t in sends)

    def _post(self, st: _Stage, post: Post) -> None:
        s = st.index
        if not post.transfers:
            raise self._error(f"s{s} has an empty Post; drop it")
        peers = {t.peer for t in post.transfers}
        if len(peers) > 1:
            raise self._error(
                f"s{s} posts {post} to both neighbours in one Post; a Post talks to one"
            )
        for t in post.transfers:
            self._post_one(st, t)

    def _post_one(self, st: _Stage, t: Transfer) -> None:
        s, peer = st.index, t.peer
        if not 0 <= s + peer < len(self.stages):
            raise self._error(f"s{s} posts {t} but has no neighbour s{s + peer}")
        if t in st.position:
            raise self._error(f"s{s} posts {t} twice")
        if t.send and _producer(s, t) not in st.ran:
            raise self._error(
                f"s{s} posts {t} before running {_producer(s, t)}; post a send after the Run"
                " that produces it"
            )
        mine, theirs = st.posted[peer], self._neighbour(st, peer).posted[-peer]
        k = len(mine)
        st.position[t] = k
        mine.append(t)
        if k < len(theirs) and (theirs[k].flow, theirs[k].microbatch) != (t.flow, t.microbatch):
            low, high = (t, theirs[k]) if peer > 0 else (theirs[k], t)
            c = min(s, s + peer)
            raise self._error(
                f"channel s{c}-s{c + 1} mismatch at op {k}: s{c} posts {low} but s{c + 1}"
                f" posts {high}; both sides must post the channel's transfers in the same"
                " order (a send on one side, its receive on the other)"
            )

    def _arrived(self, st: _Stage, t: Transfer) -> bool:
        s = st.index
        if t.send:
            raise self._error(
                f"s{s} waits for its own send {t}; only receives are waited for (sends are"
                " waited for at the end of the step)"
            )
        if t not in st.position:
            raise self._error(
                f"s{s} waits for {t} but never posted that receive; post it in an earlier Post"
            )
        if t in st.waited:
            raise self._error(f"s{s} waits for {t} twice")
        return self._matched(st, t)

    def _run(self, st: _Stage, action: Action) -> None:
        s = st.index
        if action.stage != s:
            raise self._error(f"s{s} runs {action!r}, an action of another stage")
        if action in st.ran:
            raise self._error(f"s{s} runs {action} twice")
        needed = _input(action, len(self.stages))
        if needed is not None and needed not in st.waited:
            raise self._error(
                f"s{s} runs {action} before waiting for its input {needed};"
                f" put {Wait(needed)} before it"
            )
        forward = Action(s, Op.F, action.microbatch)
        if action.op is Op.B and forward not in st.ran:
            raise self._error(f"s{s} runs {action} before {forward}")
        st.ran.add(action)

    def _stuck_on(self, st: _Stage) -> str:
        s = st.index
        if st.pc == len(st.program):
            unmatched = next(t for t in st.position if t.send and not self._matched(st, t))
            return f"s{s} ran its program but s{s + unmatched.peer} never receives its {unmatched}"
        instr = st.program[st.pc]
        if not isinstance(instr, Wait):  # only a Wait or the end of the program blocks
            raise ScheduleError(f"s{s} stopped at {instr}, which never blocks")
        t = instr.transfer
        p = s + t.peer
        name = "activation" if t.flow is Flow.ACT else "gradient"
        have = len(self.stages[p].posted[-t.peer])
        return (
            f"s{s} waits for {t} (the {name} of micro-batch {t.microbatch} from s{p}, op"
            f" {st.position[t]} on channel s{min(s, p)}-s{max(s, p)}); s{p} has posted {have}"
            " ops there"
        )

    def _error(self, message: str) -> ScheduleError:
        marks = [st.pc if not self._finished(st) else None for st in self.stages]
        programs = [st.program for st in self.stages]
        return ScheduleError(f"{message}\n{_render(programs, marks)}")


def check_programs(programs: Sequence[Program]) -> None:
    """Raise ``ScheduleError`` unless the programs run to the end in the transport model;
    the message renders what each stage is stuck on (its instruction marked ``!``).

    Checks that both sides of every channel post the same transfers in the same order, that
    no stage deadlocks, that every Wait is for a receive posted earlier and every Run's input
    was waited for, and that the Runs form a complete schedule.
    """
    if not programs:
        raise ScheduleError("there are no programs: a pipeline needs at least one stage")
    _Simulation(programs).run()
    validate(tuple(tuple(i.action for i in p if isinstance(i, Run)) for p in programs))


def render_programs(programs: Sequence[Program]) -> str:
    """One line per stage: ``s1: R<a0 W<a0 F0 S>a0 ...`` (``+`` joins a fused Post)."""
    return _render(programs, [None] * len(programs))


def _render(programs: Sequence[Program], marks: Sequence[int | None]) -> str:
    """``marks[s]``: the instruction stage s is stopped at (suffixed ``!``; past the end:
    ``end!``, waiting for its sends), or None."""
    label = len(f"s{len(programs) - 1}:")
    lines = []
    for s, (program, mark) in enumerate(zip(programs, marks, strict=True)):
        tokens = [str(i) + ("!" if n == mark else "") for n, i in enumerate(program)]
        if mark is not None and mark == len(program):
            tokens.append("end!")
        lines.append(f"{f's{s}:':<{label}} " + " ".join(tokens))
    return "\n".join(lines)


@functools.cache
def programs_for(schedule_name: str, stages: int, micro_batches: int) -> tuple[Program, ...]:
    """The checked programs of the named schedule: built, then simulated before any step runs
    them (cached, so each combination the engine runs is proven once)."""
    schedule = build(schedule_name, stages, micro_batches)
    programs = stage_programs(schedule)
    check_programs(programs)
    for s, (row, program) in enumerate(zip(schedule, programs, strict=True)):
        runs = tuple(i.action for i in program if isinstance(i, Run))
        if runs != row:
            raise ScheduleError(
                f"s{s}'s program runs {' '.join(map(str, runs))} but the schedule says"
                f" {' '.join(map(str, row))}\n{render_programs(programs)}"
            )
    return programs

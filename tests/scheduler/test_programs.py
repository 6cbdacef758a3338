"""Stage-local step programs: every built schedule's programs run to the end; broken ones are
rejected with what each stage is stuck on."""

from __future__ import annotations

import pytest

from shoal.scheduler.programs import (
    RECEIVES_AHEAD,
    Flow,
    Post,
    Program,
    Run,
    Transfer,
    Wait,
    check_programs,
    programs_for,
    render_programs,
    stage_programs,
)
from shoal.scheduler.schedules import Action, Op, ScheduleError, build, one_f_one_b

pytestmark = pytest.mark.unit


def _channel(programs: tuple[Program, ...], s: int, peer: int) -> list[tuple[Flow, int, bool]]:
    """What stage s posts to its neighbour s + peer, in order."""
    return [
        (t.flow, t.microbatch, t.send)
        for i in programs[s]
        if isinstance(i, Post)
        for t in i.transfers
        if t.peer == peer
    ]


def _runs(program: Program) -> tuple[Action, ...]:
    return tuple(i.action for i in program if isinstance(i, Run))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_built_schedule_gets_checked_programs(name: str) -> None:
    for stages in range(1, 9):
        for micro_batches in range(1, 25):
            programs = programs_for(name, stages, micro_batches)
            schedule = build(name, stages, micro_batches)
            assert [_runs(p) for p in programs] == list(schedule)
            for s in range(stages - 1):
                low, high = _channel(programs, s, 1), _channel(programs, s + 1, -1)
                assert [(f, j) for f, j, _ in low] == [(f, j) for f, j, _ in high]
                assert all(a != b for (_, _, a), (_, _, b) in zip(low, high, strict=True))
                assert len(low) == 2 * micro_batches


def test_transfers_know_their_neighbour() -> None:
    assert Transfer(Flow.ACT, 0, send=True).peer == 1
    assert Transfer(Flow.ACT, 0, send=False).peer == -1
    assert Transfer(Flow.GRAD, 0, send=True).peer == -1
    assert Transfer(Flow.GRAD, 0, send=False).peer == 1


def test_one_stage_programs_only_run() -> None:
    for name in ("gpipe", "1f1b"):
        (program,) = programs_for(name, 1, 5)
        assert all(isinstance(i, Run) for i in program)
        assert len(program) == 10


def test_1f1b_steady_state_fuses_send_forward_recv_backward() -> None:
    # A middle stage sends an activation and posts the receive of the gradient it needs next
    # in one batch_isend_irecv, and likewise toward its upstream neighbour, where it also
    # posts the receive of the activation after next (one ahead).
    programs = programs_for("1f1b", 4, 8)
    posts = {str(i) for i in programs[1] if isinstance(i, Post)}
    assert "S>a4+R>g2" in posts
    assert "R<a5+S<g1" in posts


def test_render_1f1b_programs() -> None:
    assert render_programs(programs_for("1f1b", 3, 2)).splitlines() == [
        "s0: F0 S>a0 F1 S>a1+R>g0+R>g1 W>g0 B0 W>g1 B1",
        "s1: R<a0+R<a1 W<a0 F0 S>a0 W<a1 F1 S>a1+R>g0+R>g1 W>g0 B0 S<g0 W>g1 B1 S<g1",
        "s2: R<a0+R<a1 W<a0 F0 B0 S<g0 W<a1 F1 B1 S<g1",
    ]


def _posted_ahead(program: Program, flow: Flow) -> list[bool]:
    """For each receive of ``flow`` after the first, whether it was posted before the Wait
    of the previous one of its flow (so its data can arrive while the stage computes)."""
    posted: dict[int, int] = {}
    waited: dict[int, int] = {}
    for n, instr in enumerate(program):
        if isinstance(instr, Post):
            posted.update({t.microbatch: n for t in instr.transfers if t.flow is flow})
        elif isinstance(instr, Wait) and instr.transfer.flow is flow:
            waited[instr.transfer.microbatch] = n
    return [posted[j] < waited[j - 1] for j in sorted(waited) if j - 1 in waited]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_last_stage_receives_each_activation_one_ahead(name: str) -> None:
    # The pipeline's critical path: the last stage's next activation is on its way while it
    # computes the current micro-batch, on every shape (and never more than two posted).
    for stages in range(2, 9):
        for micro_batches in range(2, 25):
            last = programs_for(name, stages, micro_batches)[-1]
            assert all(_posted_ahead(last, Flow.ACT)), (name, stages, micro_batches)
            held = 0
            for instr in last:
                if isinstance(instr, Post):
                    held += sum(1 for t in instr.transfers if not t.send)
                    assert held <= RECEIVES_AHEAD
                elif isinstance(instr, Wait):
                    held -= 1


def _naive(stages: int, micro_batches: int) -> tuple[Program, ...]:
    """Each stage posts each transfer alone, in its own order: receive right before it is
    needed, send right after it is produced."""
    programs = []
    for actions in one_f_one_b(stages, micro_batches):
        program: list[Post | Wait | Run] = []
        for a in actions:
            first, last = a.stage == 0, a.stage == stages - 1
            flow = Flow.ACT if a.op is Op.F else Flow.GRAD
            if not (first if a.op is Op.F else last):
                program += [Post((Transfer(flow, a.microbatch, False),))]
                program += [Wait(Transfer(flow, a.microbatch, False))]
            program.append(Run(a))
            if not (last if a.op is Op.F else first):
                program.append(Post((Transfer(flow, a.microbatch, True),)))
        programs.append(tuple(program))
    return tuple(programs)


def test_naive_1f1b_programs_are_a_channel_mismatch() -> None:
    with pytest.raises(ScheduleError, match="mismatch") as error:
        check_programs(_naive(4, 8))
    assert "channel s2-s3 mismatch at op 1: s2 posts S>a1 but s3 posts S<g0" in str(error.value)


def test_a_missing_send_deadlocks_and_names_the_wait() -> None:
    programs = list(programs_for("1f1b", 4, 8))
    assert str(programs[2][-1]) == "S<g7"
    programs[2] = programs[2][:-1]
    with pytest.raises(ScheduleError, match="deadlock") as error:
        check_programs(programs)
    message = str(error.value)
    assert "s1 waits for R>g7 (the gradient of micro-batch 7 from s2" in message
    assert "s0 waits for R>g7 (the gradient of micro-batch 7 from s1" in message
    assert "W>g7!" in message.splitlines()[-3]  # s1's line marks where it is stuck


def test_an_unmatched_send_deadlocks_at_the_end() -> None:
    programs = list(programs_for("gpipe", 2, 1))
    assert render_programs(programs).splitlines()[0] == "s0: F0 S>a0+R>g0 W>g0 B0"
    programs[0] = (programs[0][0], Post((Transfer(Flow.ACT, 0, True),)))
    with pytest.raises(ScheduleError, match="deadlock") as error:
        check_programs(programs)
    assert "s1 ran its program but s0 never receives its S<g0" in str(error.value)
    assert str(error.value).splitlines()[-1].endswith("S<g0 end!")


def test_a_send_before_its_run_is_rejected() -> None:
    programs = list(programs_for("gpipe", 2, 2))
    programs[0] = (Post((Transfer(Flow.ACT, 1, True),)), *programs[0])
    with pytest.raises(ScheduleError, match="s0 posts S>a1 before running F1"):
        check_programs(programs)


def test_a_run_before_its_wait_is_rejected() -> None:
    programs = list(programs_for("gpipe", 3, 2))
    wait, run = programs[1][1], programs[1][2]
    assert (str(wait), str(run)) == ("W<a0", "F0")
    programs[1] = (programs[1][0], run, wait, *programs[1][3:])
    with pytest.raises(ScheduleError, match="s1 runs F0 before waiting for its input R<a0"):
        check_programs(programs)


def test_a_wait_for_a_receive_never_posted_is_rejected() -> None:
    programs = list(programs_for("gpipe", 2, 1))
    programs[1] = tuple(i for i in programs[1] if str(i) != "R<a0")
    with pytest.raises(ScheduleError, match="s1 waits for R<a0 but never posted"):
        check_programs(programs)


def test_a_post_to_both_neighbours_or_off_the_pipeline_is_rejected() -> None:
    both = Post((Transfer(Flow.ACT, 0, False), Transfer(Flow.GRAD, 0, False)))
    programs = list(programs_for("gpipe", 3, 1))
    programs[1] = (both, *programs[1])
    with pytest.raises(ScheduleError, match="to both neighbours in one Post"):
        check_programs(programs)
    programs = list(programs_for("gpipe", 2, 1))
    programs[0] = (Post((Transfer(Flow.ACT, 0, False),)), *programs[0])
    with pytest.raises(ScheduleError, match="s0 posts R<a0 but has no neighbour s-1"):
        check_programs(programs)


def test_programs_whose_runs_are_incomplete_are_rejected() -> None:
    # The transfers of micro-batch 1's backward dropped on both sides: the simulation ends,
    # but the Runs no longer form a complete schedule.
    programs = list(stage_programs(build("gpipe", 2, 2)))
    programs[1] = tuple(i for i in programs[1] if str(i) not in ("B1", "S<g1"))
    g1 = Transfer(Flow.GRAD, 1, send=False)
    programs[0] = tuple(
        Post(tuple(t for t in i.transfers if t != g1)) if isinstance(i, Post) else i
        for i in programs[0]
        if str(i) not in ("W>g1", "B1")
    )
    assert "R>g1" not in render_programs(programs)
    with pytest.raises(ScheduleError, match="stage 0 never runs B1"):
        check_programs(programs)

"""The job state machine: terminal states, allowed and refused transitions."""

from __future__ import annotations

import pytest

from shoal.service.lifecycle import TRANSITIONS, InvalidTransition, JobState, check_transition

pytestmark = pytest.mark.unit


def test_terminal_states() -> None:
    assert {s for s in JobState if s.is_terminal} == {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    }


def test_every_state_has_a_rule() -> None:
    assert set(TRANSITIONS) == set(JobState)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (JobState.QUEUED, JobState.RUNNING),
        (JobState.QUEUED, JobState.CANCELLED),
        (JobState.RUNNING, JobState.SUCCEEDED),
        (JobState.RUNNING, JobState.RECOVERING),
        (JobState.RECOVERING, JobState.RUNNING),
        (JobState.FAILED, JobState.QUEUED),
        (JobState.CANCELLED, JobState.QUEUED),
    ],
)
def test_allowed(current: JobState, target: JobState) -> None:
    check_transition(current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (JobState.SUCCEEDED, JobState.QUEUED),
        (JobState.SUCCEEDED, JobState.RUNNING),
        (JobState.QUEUED, JobState.SUCCEEDED),
        (JobState.FAILED, JobState.RUNNING),
        (JobState.CANCELLED, JobState.SUCCEEDED),
        (JobState.RUNNING, JobState.RUNNING),
    ],
)
def test_refused_with_a_message(current: JobState, target: JobState) -> None:
    with pytest.raises(InvalidTransition, match=f"{current} job cannot become {target}"):
        check_transition(current, target)


def test_only_active_states_hold_devices() -> None:
    assert {s for s in JobState if s.holds_devices} == {JobState.RUNNING, JobState.RECOVERING}

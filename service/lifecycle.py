"""Job states and the transitions between them: written once here, enforced where persisted.

Who changes what: the API creates jobs in QUEUED, cancels QUEUED jobs directly (RUNNING ones
only get ``cancel_requested``, which the controller carries out) and requeues FAILED or
CANCELLED jobs on restart. The controller moves QUEUED -> RUNNING when it places a job, and
RUNNING/RECOVERING onwards from what the runner reports. Every transition is an event row
(``service.jobs.transition``).
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def holds_devices(self) -> bool:
        return self in (JobState.RUNNING, JobState.RECOVERING)


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.RECOVERING,
            JobState.QUEUED,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.RECOVERING: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}
    ),
    # Terminal, but a user may restart a failed or cancelled job: it resumes from a checkpoint.
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset({JobState.QUEUED}),
    JobState.CANCELLED: frozenset({JobState.QUEUED}),
}


class InvalidTransition(ValueError):
    def __init__(self, current: JobState, target: JobState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none"
        super().__init__(f"a {current} job cannot become {target} (from {current}: {allowed})")
        self.current = current
        self.target = target


def check_transition(current: JobState, target: JobState) -> None:
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(current, target)

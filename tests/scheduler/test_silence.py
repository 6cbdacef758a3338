"""A device none of whose calls ends for the timeout is silent (``scheduler.silence``)."""

from __future__ import annotations

import pytest

from shoal.scheduler.silence import Silence


def test_a_device_is_silent_once_none_of_its_calls_ended_for_the_timeout() -> None:
    silence = Silence(10.0)
    silence.heard(pending=[0, 1], ended=[], now=0.0)  # both start calls
    assert silence.left(0.0) == 10.0
    silence.heard(pending=[0, 1], ended=[1], now=6.0)  # device 1 answers
    assert silence.silent(9.9) == [] and silence.left(9.0) == pytest.approx(1.0)
    assert silence.silent(10.0) == [0]  # device 0 never did
    silence.heard(pending=[0, 1], ended=[1], now=15.0)
    assert silence.silent(15.9) == [0] and silence.left(15.9) == 0.0


def test_a_device_with_nothing_under_way_is_never_silent_and_starts_afresh() -> None:
    silence = Silence(10.0)
    silence.heard(pending=[0], ended=[], now=0.0)
    silence.heard(pending=[], ended=[0], now=5.0)  # its last call ended: idle
    assert silence.silent(100.0) == [] and silence.left(100.0) == 10.0
    silence.heard(pending=[0], ended=[], now=100.0)  # new calls: counted from now
    assert silence.silent(109.0) == [] and silence.silent(110.0) == [0]


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="task timeout"):
        Silence(0.0)

"""A local Ray cluster a killed `shoal up` left whose head does not answer is stopped, every
process of it, before `shoal up` starts a new one."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.service.devicespec import parse_devices
from shoal.service.localray import LocalRay, LocalRayError
from shoal.service.localray_record import RECORD, ProcessId
from tests.service.stand_ins import record_cluster, running_in_session

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("head", ["nothing-listens", "listens-silent"])
def test_a_recorded_cluster_whose_head_does_not_answer_is_stopped_before_a_new_one_starts(
    head: str,
    fake_node: subprocess.Popen[bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recorded cluster runs the wanted device groups and its node lives, but its head
    does not answer: nothing accepts connections at its address, or something does and no
    Ray answers there within the adoption's time. Its node (session and all) is stopped
    before the new cluster's head is launched (that start is cut short here by its start
    timeout), and `start` says why it was not adopted."""
    path = tmp_path / RECORD
    identity = ProcessId.of(fake_node.pid)
    assert identity is not None
    record = record_cluster(path, {"1xcpu:64": identity})
    with socket.socket() as silent:
        if head == "listens-silent":  # accepts connections (the kernel's), answers nothing
            silent.bind(("127.0.0.1", 0))
            silent.listen(16)
            record = replace(record, address=f"127.0.0.1:{silent.getsockname()[1]}")
            record.write(path)
        local = LocalRay(
            parse_devices("1xcpu:64"),
            tmp_path / "logs",
            record_path=path,
            start_timeout_s=0.1,
            adopt_timeout_s=1.0,
            stop_timeout_s=1.0,
        )
        at_launch: list[tuple[int | None, list[str]]] = []
        launch = LocalRay._launch

        def launching(self: LocalRay, index: int, *args: Any, **kwargs: Any) -> Any:
            at_launch.append((fake_node.poll(), running_in_session(fake_node.pid)))
            return launch(self, index, *args, **kwargs)

        monkeypatch.setattr(LocalRay, "_launch", launching)
        with pytest.raises(LocalRayError, match="waiting for the Ray head to accept connections"):
            local.start()
    where = f"stopped the local Ray cluster at {record.address} an earlier `shoal up` left running"
    previous = local.previous or ""
    assert previous.startswith(f"{where}: "), previous
    if head == "nothing-listens":
        assert previous == f"{where}: its head does not accept connections at {record.address}"
    else:  # adopted, then given up on: no Ray node answered
        assert "Ray nodes to be alive" in previous, previous
    # The new cluster's head was launched once, after the old node and its session were gone.
    assert len(at_launch) == 1, at_launch
    assert at_launch[0][0] is not None and at_launch[0][1] == [], at_launch
    assert fake_node.wait(timeout=10) < 0 and running_in_session(fake_node.pid) == []
    assert not path.exists()  # the new cluster's record went with it

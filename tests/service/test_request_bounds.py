"""No single submission may take the control plane's memory or CPU: each hostile spec below
is checked in a process of its own, under an address-space cap, and must be answered (taken
or refused naming the field) holding a few MiB, within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shoal.service.memo import OnceEach
from shoal.service.spec_errors import SpecError
from shoal.service.sweepspec import (
    MAX_CHECKED_BLOCKS,
    MAX_GRID,
    ParamSpec,
    SweepSpec,
    grid_values,
    validate_sweep_spec,
)
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MAX_GROWTH_MIB = 64
"""What one checked submission may add to the process's peak memory."""

_CHECK = r"""
import json, resource, sys, time
from shoal.service.spec_errors import SpecError
from shoal.service.specs import validate_job_spec
from shoal.service.sweepspec import validate_sweep_spec

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

kind, payload, cap_mib = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
validate = validate_job_spec if kind == "job" else validate_sweep_spec
# Imports and a first trace are the process's, not the request's.
validate_job_spec({"name": "warm", "model": {"builtin": "mlp"},
                   "data": {"builtin": "synthetic-regression"}, "steps": 1}, [])
# A regression fails fast under the cap instead of taking the machine's memory.
cap = (kib("VmSize") + cap_mib * 1024) * 1024
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    validate(payload, [])
    outcome, errors = "accepted", []
except SpecError as exc:
    outcome, errors = "refused", exc.errors
except BaseException as exc:
    outcome, errors = type(exc).__name__, [("", str(exc)[:500])]
print(json.dumps({
    "outcome": outcome,
    "errors": errors,
    "seconds": time.perf_counter() - start,
    "growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024,
}))
"""


def check_alone(kind: str, payload: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    """Validate ``payload`` (a job or sweep spec) in a fresh process capped at 1 GiB more
    than it had; what happened, how long it took and how much its peak memory grew."""
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, kind, json.dumps(payload), "1024"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    print(kind, result)  # the figures, for docs/reliability.md's table (pytest -s)
    return result


_HOSTILE_JOBS = {
    # Each field at its bound: a real sample batch would be 64 GiB of token ids.
    "lm-8k-tokens-x-1M-rows": job_spec(
        model={"builtin": "gpt", "config": {"d_model": 8, "n_heads": 1, "n_layers": 1}},
        data={"builtin": "synthetic-lm", "config": {"seq_len": 8_192, "vocab_size": 65_536}},
        batch_size=1_048_576,
    ),
    "pysource-whole-corpus-1M-windows": job_spec(
        model={"builtin": "gpt", "config": {"d_model": 8, "n_heads": 1, "n_layers": 1}},
        data={"builtin": "pysource", "config": {"max_bytes": 200_000_000, "seq_len": 8_192}},
        batch_size=1_048_576,
    ),
    "digits-1M-rows": job_spec(batch_size=1_048_576),
    # Depth: 1,026 blocks, of which three are distinct.
    "gpt-1024-layers": job_spec(
        model={"builtin": "gpt", "config": {"n_layers": 1_024}},
        data={"builtin": "synthetic-lm"},
    ),
}


@pytest.mark.parametrize("name", _HOSTILE_JOBS)
def test_a_hostile_job_is_checked_in_bounded_memory_and_time(name: str) -> None:
    result = check_alone("job", _HOSTILE_JOBS[name])
    assert result["outcome"] == "accepted", result
    assert result["growth_mib"] < MAX_GROWTH_MIB, result
    assert result["seconds"] < 10, result


def test_a_grid_as_wide_as_the_seed_is_refused_before_anything_is_listed() -> None:
    spec = sweep_spec(
        algorithm="grid", space={"seed": {"type": "int", "low": 0, "high": 2**31 - 1}}
    )
    result = check_alone("sweep", spec)
    assert result["outcome"] == "refused", result
    ((field, message),) = result["errors"]
    assert field == "space.seed", result
    assert message.startswith("the grid has 2147483648 points (seed: 2147483648 values)")
    assert f"more than {MAX_GRID}; narrow space.seed" in message
    assert result["growth_mib"] < MAX_GROWTH_MIB and result["seconds"] < 5, result


def test_a_sweep_over_hundreds_of_deep_models_is_refused_in_bounded_time() -> None:
    """Each value of the space is a model to trace and check: their blocks are bounded."""
    spec = sweep_spec(
        base=job_spec(
            model={"builtin": "gpt", "config": {"n_layers": 1_000}},
            data={"builtin": "synthetic-lm"},
            steps=10,
        ),
        space={
            "model.config.n_layers": {"type": "categorical", "choices": list(range(990, 1022))},
            "model.config.d_model": {"type": "categorical", "choices": list(range(32, 1056, 32))},
        },
    )
    result = check_alone("sweep", spec, timeout_s=120)
    assert result["outcome"] == "refused", result
    ((field, message),) = result["errors"]
    assert field == "space.model.config.n_layers", result
    assert f"more than {MAX_CHECKED_BLOCKS:,}; give fewer choices" in message
    assert result["growth_mib"] < MAX_GROWTH_MIB and result["seconds"] < 20, result


def test_a_grid_is_counted_by_arithmetic_and_blamed_on_its_widest_dimension() -> None:
    space = {
        "optimizer.lr": {"type": "categorical", "choices": [0.01, 0.1]},
        "model.config.hidden": {"type": "int", "low": 1, "high": 60_000},
    }
    started = time.perf_counter()
    with pytest.raises(SpecError) as caught:
        validate_sweep_spec(sweep_spec(algorithm="grid", space=space), [])
    ((field, message),) = caught.value.errors
    assert field == "space.model.config.hidden"
    assert "120000 points (optimizer.lr: 2 x model.config.hidden: 60000 values)" in message
    assert time.perf_counter() - started < 1


def test_a_dimension_and_a_grid_are_never_listed_past_the_bound() -> None:
    """The grid sampler lists every point: it gets none from a grid too large."""
    wide = ParamSpec(type="int", low=0, high=1e300)
    assert wide.grid_length() == int(1e300) + 1
    with pytest.raises(ValueError, match="more than 10000"):
        wide.grid()
    points = {f"model.config.p{i}": {"type": "int", "low": 1, "high": 10} for i in range(16)}
    spec = SweepSpec.model_validate(sweep_spec(algorithm="grid", space=points))
    with pytest.raises(ValueError, match="the grid has about 10\\^16 points"):
        grid_values(spec.space)


def test_a_memo_is_bounded_in_bytes_as_well_as_entries() -> None:
    memo: OnceEach[bytes] = OnceEach(100, max_bytes=10_000, weigh=len)
    for i in range(10):
        memo.get(f"k{i}", lambda: b"x" * 3_000)
    assert memo.bytes <= 10_000  # three values kept, the oldest dropped
    computed = []

    def compute() -> bytes:
        computed.append(1)
        return b""

    memo.get("k9", compute)
    memo.get("k0", compute)
    assert computed == [1]  # the newest is kept, the oldest was not
    huge_key = "k" * 20_000  # a key is counted too: a whole config can be most of a body
    memo.get(huge_key, lambda: b"")
    assert memo.bytes <= 10_000

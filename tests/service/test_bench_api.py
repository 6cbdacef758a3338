"""``shoal bench api``: its arithmetic, and one tiny run against SQLite (not timed)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from click.testing import CliRunner

from shoal.service.bench.api import (
    API_KEYS,
    ApiSettings,
    Samples,
    api_result,
    check,
    percentile,
    run_api_bench,
    server_errors,
)
from shoal.service.cli import cli

# 30 keys make 60 submissions at once, more than the 40 request threads and their 40 pooled
# connections: the run passes only if no request holds a connection while it waits for
# another (it once did, through its caller's authentication, and 15 at once deadlocked).
TINY = ApiSettings(clients=4, duration_s=1.5, submissions=30, jobs=20, workers=2)


@pytest.mark.unit
def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values[::-1], 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) == 0.0


@pytest.mark.unit
def test_samples_keep_latencies_of_successes_and_the_route_of_failures() -> None:
    samples = Samples()
    samples.add("status", time.perf_counter(), None)
    samples.add("submit", time.perf_counter(), "ReadTimeout")
    assert len(samples.latencies_ms["status"]) == 1 and samples.latencies_ms["status"][0] >= 0
    assert samples.errors == ["ReadTimeout POST /api/v1/jobs"]


@pytest.mark.unit
def test_result_counts_every_failure_and_checks_one_job_per_key() -> None:
    load = Samples(
        latencies_ms={"status": [1.0, 2.0, 3.0], "list": [10.0]},
        errors=["429 GET /api/v1/jobs/{id}"],
        seconds=2.0,
    )
    submit = Samples(
        latencies_ms={"submit": [5.0, 6.0]}, errors=["ReadTimeout POST /api/v1/jobs"], seconds=1
    )
    result = api_result(
        ApiSettings(submissions=1),
        load,
        submit,
        jobs_created=2,
        keys_split=1,
        during_load={"server_cpu_s": 1.0, "load_generator_cpu_s": 0.5, "load_average_1m": 1},
        server={"workers": 1},
        server_errors=[],
        started=0.0,
    )
    assert list(result)[: len(API_KEYS)] == list(API_KEYS)
    assert result["status_requests_per_s"] == 2.0  # 4 successful requests in 2 s
    assert (result["p50_ms"], result["p99_ms"], result["list_p99_ms"]) == (2.0, 10.0, 10.0)
    assert (result["errors"], result["rate_limited"]) == (2, 1)
    problems = check(result)
    assert len(problems) == 3
    assert "2 jobs created for 1 idempotency keys" in problems[1]


@pytest.mark.unit
def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        ApiSettings(clients=0)
    with pytest.raises(ValueError, match="duration"):
        ApiSettings(duration_s=0)
    with pytest.raises(ValueError, match="PostgreSQL"):
        ApiSettings(database_url="sqlite:///x.db")


@pytest.mark.unit
def test_server_errors_are_the_last_lines_of_tracebacks() -> None:
    log = (
        "ERROR:    Exception in ASGI application\nTraceback (most recent call last):\n"
        '  File "x.py", line 1\n    raise TimeoutError(\n'
        "sqlalchemy.exc.TimeoutError: QueuePool limit reached\n"
        "sqlalchemy.exc.TimeoutError: QueuePool limit reached\n"
    )
    assert server_errors(log) == ["sqlalchemy.exc.TimeoutError: QueuePool limit reached"]


def _check_tiny(result: dict[str, Any]) -> None:
    assert set(API_KEYS) <= set(result)
    assert result["errors"] == 0, result["error_samples"]
    assert result["jobs_created"] == result["submissions"] == TINY.submissions
    assert result["submit_keys_answered_differently"] == 0
    assert result["requests"] > 0 and result["status_requests"] > 0
    assert result["list_requests"] > 0
    assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["status_requests_per_s"] > 0
    assert result["load_seconds"] >= TINY.duration_s
    assert result["settings"]["clients"] == TINY.clients
    assert result["server"]["workers"] == result["settings"]["workers"]
    assert check(result) == []


@pytest.mark.integration
def test_a_tiny_run_has_no_errors_and_one_job_per_key() -> None:
    _check_tiny(run_api_bench(TINY))


@pytest.mark.integration
def test_the_cli_prints_the_result_as_json_on_its_last_line() -> None:
    args = ["bench", "api", "--clients", "4", "--duration", "1.5", "--submissions", "30"]
    result = CliRunner().invoke(cli, [*args, "--jobs", "20", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    _check_tiny(json.loads(result.output.strip().splitlines()[-1]))


@pytest.mark.unit
def test_the_cli_refuses_a_database_that_is_not_postgresql() -> None:
    result = CliRunner().invoke(cli, ["bench", "api", "--database-url", "sqlite:///x.db"])
    assert result.exit_code == 2
    assert "PostgreSQL" in result.output

"""The sweeps API over a real database: contract, visibility, paging, cancel, trials, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shoal.service.auth import Principal
from shoal.service.db.models import DeviceRow, Job, Sweep, Trial, User
from shoal.service.jobs import add_job, transition
from shoal.service.lifecycle import JobState
from shoal.service.specs import validate_job_spec
from shoal.service.sweeps import move_sweep
from tests.api.conftest import Api
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.integration

SWEEPS = "/api/v1/sweeps"
TRIAL_STATES = ("QUEUED", "RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED", "PRUNED")
NO_TRIALS = dict.fromkeys(TRIAL_STATES, 0)


def submit(api: Api, headers: dict[str, str], **overrides: Any) -> dict[str, Any]:
    r = api.client.post(SWEEPS, json=sweep_spec(**overrides), headers=headers)
    assert r.status_code == 201, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_submit_then_read_back(api: Api) -> None:
    alice = api.token("alice")
    sweep = submit(api, alice)
    assert (sweep["state"], sweep["owner"], sweep["name"]) == ("QUEUED", "alice", "lr-sweep")
    assert sweep["max_trials"] == 8 and sweep["cancel_requested"] is False
    assert sweep["objective"] == {"metric": "loss", "direction": "minimize"}
    assert sweep["trials"] == [] and sweep["best"] is None and sweep["trial_counts"] == NO_TRIALS
    assert sweep["spec"]["space"]["optimizer.lr"]["type"] == "log_uniform"
    assert sweep["spec"]["retention"] == {"keep_best": 2}

    got = api.client.get(f"{SWEEPS}/{sweep['id']}", headers=alice)
    assert got.status_code == 200 and got.json() == sweep
    with api.factory() as session:  # no trial and no job until the controller starts them
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0


def test_idempotency_key_returns_the_same_sweep_per_owner(api: Api) -> None:
    alice, bob = api.token("alice"), api.token("bob")
    keyed = {**alice, "Idempotency-Key": "s-1"}
    first = api.client.post(SWEEPS, json=sweep_spec(), headers=keyed)
    again = api.client.post(SWEEPS, json=sweep_spec(), headers=keyed)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    other = api.client.post(SWEEPS, json=sweep_spec(max_trials=9), headers=keyed)
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]
    assert api.client.get(SWEEPS, headers=alice).json()["total"] == 1
    # A key is the owner's: another user's same key makes a sweep of theirs.
    bobs = api.client.post(SWEEPS, json=sweep_spec(), headers={**bob, "Idempotency-Key": "s-1"})
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
    # Without a key, every submission is a new sweep.
    assert submit(api, alice)["id"] != submit(api, alice)["id"]


def test_a_small_grid_runs_fewer_trials_than_max_trials(api: Api) -> None:
    sweep = submit(
        api,
        api.token("alice"),
        algorithm="grid",
        space={"batch_size": {"type": "categorical", "choices": [16, 32, 64]}},
    )
    assert sweep["max_trials"] == 3


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (
            {"space": {"optimizer.nope": {"type": "uniform", "low": 0.1, "high": 0.2}}},
            "space.optimizer.nope",
            "optimizer has no field 'nope'",
        ),
        (
            {"space": {"optimizer.lr": {"type": "log_uniform", "low": 0, "high": 0.1}}},
            "space.optimizer.lr",
            "log_uniform needs low > 0, got 0",
        ),
        (
            {"algorithm": "grid"},
            "space.optimizer.lr",
            "grid search needs finite values; log_uniform has none",
        ),
        (
            {"space": {"batch_size": {"type": "categorical", "choices": [32, 3]}}},
            "space.batch_size",
            "the value 3 makes an invalid job",
        ),
        ({"space": {"name": {"type": "categorical", "choices": ["a"]}}}, "space", "not a field"),
        ({"space": {}}, "space", "at least 1 item"),
        ({"max_trials": 0}, "max_trials", "greater than or equal to 1"),
        ({"base": job_spec(steps=-1)}, "base.steps", "greater than or equal to 1"),
    ],
)
def test_bad_sweeps_are_422_naming_the_field(
    api: Api, overrides: dict[str, Any], field: str, message: str
) -> None:
    r = api.client.post(SWEEPS, json=sweep_spec(**overrides), headers=api.token("alice"))
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert field in errors and message in errors[field], errors
    assert "Traceback" not in r.text
    with api.factory() as session:  # nothing half-written
        assert session.scalar(sa.select(sa.func.count()).select_from(Sweep)) == 0
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0


def test_base_job_completion_errors_are_named_under_base(api: Api) -> None:
    base = job_spec(model={"builtin": "mlp", "config": {"layers": 10**12}})
    r = api.client.post(SWEEPS, json=sweep_spec(base=base), headers=api.token("alice"))
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["base.model.config.layers"]


def one_device(api: Api, *, memory_mb: int) -> None:
    """The controller has seen one live device of ``memory_mb``."""
    with api.factory() as session, session.begin():
        row = DeviceRow(
            id="n1-cpu-0", node_id="n1", kind="cpu", memory_mb=memory_mb, gpu=False, spot=False
        )
        row.state = "alive"
        session.add(row)


def test_a_base_job_too_big_for_every_device_is_refused(api: Api) -> None:
    alice = api.token("alice")
    one_device(api, memory_mb=2048)
    huge = job_spec(model={"builtin": "mlp", "config": {"hidden": 8192, "layers": 40}})
    r = api.client.post(SWEEPS, json=sweep_spec(base=huge, executor="jobs"), headers=alice)
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == "base.resources.max_devices"
    assert "largest device has 2.0 GiB" in error["message"]


def test_a_space_value_too_big_for_every_device_is_refused_naming_the_path(api: Api) -> None:
    alice = api.token("alice")
    one_device(api, memory_mb=2048)
    space = {"model.config.hidden": {"type": "categorical", "choices": [32, 4096]}}
    base = job_spec(model={"builtin": "mlp", "config": {"hidden": 32, "layers": 40}})
    jobs = sweep_spec(base=base, space=space, executor="jobs")
    r = api.client.post(SWEEPS, json=jobs, headers=alice)
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == "space.model.config.hidden"
    assert error["message"].startswith("the value 4096 makes an invalid job (resources.max_")
    assert "largest device has 2.0 GiB" in error["message"]
    # Under SHARP a model only needs each block to fit half a device: 40 layers of 4096 do,
    # a layer of 65536 does not.
    sharp = sweep_spec(base=base, space=space)
    assert api.client.post(SWEEPS, json=sharp, headers=alice).status_code == 201
    wide = {"model.config.hidden": {"type": "categorical", "choices": [32, 65536]}}
    short = job_spec(model={"builtin": "mlp", "config": {"hidden": 32, "layers": 2}})
    r = api.client.post(SWEEPS, json=sweep_spec(base=short, space=wide), headers=alice)
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == "space.model.config.hidden"
    assert error["message"].startswith("the value 65536 makes an invalid job (micro_batches: ")


def test_others_sweeps_are_404_admins_see_all(api: Api) -> None:
    alice, bob, root = api.token("alice"), api.token("bob"), api.token("root", admin=True)
    sweep_id = submit(api, alice)["id"]
    for r in (
        api.client.get(f"{SWEEPS}/{sweep_id}", headers=bob),
        api.client.post(f"{SWEEPS}/{sweep_id}/cancel", headers=bob),
        api.client.get(f"{SWEEPS}/deadbeef", headers=alice),
    ):
        assert r.status_code == 404 and r.json()["detail"].startswith("no sweep '")
    assert api.client.get(SWEEPS, headers=bob).json()["total"] == 0
    assert api.client.get(f"{SWEEPS}/{sweep_id}", headers=root).json()["owner"] == "alice"
    assert api.client.get(SWEEPS, headers=root).json()["total"] == 1
    assert api.client.get(SWEEPS).status_code == 401


def test_list_is_paged_newest_first_without_specs(api: Api) -> None:
    alice = api.token("alice")
    ids = [submit(api, alice, name=f"s{i}")["id"] for i in range(3)]
    first = api.client.get(SWEEPS, params={"limit": 2}, headers=alice).json()
    assert (first["total"], first["limit"], first["offset"]) == (3, 2, 0)
    rest = api.client.get(SWEEPS, params={"limit": 2, "offset": 2}, headers=alice).json()
    assert len(first["items"]) == 2 and len(rest["items"]) == 1
    listed = [s["id"] for s in first["items"] + rest["items"]]
    assert sorted(listed) == sorted(ids)
    item = first["items"][0]
    assert "spec" not in item and "trials" not in item
    assert item["trial_counts"] == NO_TRIALS and item["best"] is None
    assert api.client.get(SWEEPS, params={"limit": 10_000}, headers=alice).json()["limit"] == 100
    bad = api.client.get(SWEEPS, params={"offset": -1}, headers=alice)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "offset"


def test_cancel_queued_then_conflicts(api: Api) -> None:
    alice = api.token("alice")
    sweep_id = submit(api, alice)["id"]
    r = api.client.post(f"{SWEEPS}/{sweep_id}/cancel", headers=alice)
    assert r.status_code == 200, r.text
    cancelled = r.json()
    assert cancelled["state"] == "CANCELLED" and cancelled["finished_at"] is not None
    assert cancelled["error"] == "cancelled by alice"
    again = api.client.post(f"{SWEEPS}/{sweep_id}/cancel", headers=alice)
    assert again.status_code == 409 and "already CANCELLED" in again.json()["detail"]


def principal(session: Session, name: str) -> Principal:
    user = session.scalar(sa.select(User).where(User.name == name))
    assert user is not None
    return Principal(user.id, user.name, user.is_admin)


def add_trial(
    session: Session,
    sweep_id: str,
    number: int,
    states: list[JobState],
    **fields: Any,
) -> Trial:
    """A trial whose job went through ``states``, as the sweeper would have recorded it."""
    lr = 0.01 * (number + 1)
    accepted = validate_job_spec(job_spec(optimizer={"name": "sgd", "lr": lr}), [])
    job = add_job(session, principal(session, "alice"), accepted)
    for state in states:
        transition(session, job, state, "test")
    trial = Trial(sweep_id=sweep_id, number=number, job_id=job.id, params={"optimizer.lr": lr})
    for key, value in fields.items():
        setattr(trial, key, value)
    session.add(trial)
    return trial


@pytest.mark.parametrize(("direction", "best"), [("minimize", 2), ("maximize", 0)])
def test_trials_show_states_objectives_intermediate_values_and_the_best(
    api: Api, direction: str, best: int
) -> None:
    alice = api.token("alice")
    objective = {"metric": "loss", "direction": direction, "every_steps": 5}
    sweep_id = submit(api, alice, objective=objective)["id"]
    run, done = JobState.RUNNING, JobState.SUCCEEDED
    with api.factory() as session, session.begin():
        sweep = session.get(Sweep, sweep_id)
        assert sweep is not None
        move_sweep(sweep, run)
        add_trial(
            session,
            sweep_id,
            0,
            [run, done],
            objective=0.9,
            intermediate={"10": 1.1, "5": 1.5, "15": 0.9},
            told=True,
        )
        add_trial(
            session,
            sweep_id,
            1,
            [run, JobState.CANCELLED],
            pruned=True,
            intermediate={"5": 2.5},
            told=True,
            checkpoints_dropped=True,
        )
        add_trial(session, sweep_id, 2, [run, done], objective=0.4, told=True)
        add_trial(session, sweep_id, 3, [JobState.FAILED], told=True, checkpoints_dropped=True)
        add_trial(session, sweep_id, 4, [run], intermediate={"5": 3.0})
        add_trial(session, sweep_id, 5, [])

    r = api.client.get(f"{SWEEPS}/{sweep_id}", headers=alice)
    assert r.status_code == 200, r.text
    sweep = r.json()
    assert sweep["state"] == "RUNNING" and sweep["objective"]["direction"] == direction
    trials = sweep["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2, 3, 4, 5]
    assert [t["state"] for t in trials] == [
        "SUCCEEDED",
        "PRUNED",
        "SUCCEEDED",
        "FAILED",
        "RUNNING",
        "QUEUED",
    ]
    assert [t["objective"] for t in trials] == [0.9, None, 0.4, None, None, None]
    assert trials[0]["intermediate"] == [
        {"step": 5, "value": 1.5},
        {"step": 10, "value": 1.1},
        {"step": 15, "value": 0.9},
    ]
    assert (
        trials[1]["intermediate"] == [{"step": 5, "value": 2.5}] and trials[5]["intermediate"] == []
    )
    assert [t["checkpoints_kept"] for t in trials] == [True, False, True, False, True, True]
    assert trials[3]["params"] == {"optimizer.lr": pytest.approx(0.04)}
    with api.factory() as session:
        jobs = {t.number: t.job_id for t in session.scalars(sa.select(Trial))}
    assert [t["job_id"] for t in trials] == [jobs[n] for n in range(6)]
    assert sweep["best"] == trials[best]
    assert sweep["trial_counts"] == NO_TRIALS | {
        "SUCCEEDED": 2,
        "PRUNED": 1,
        "FAILED": 1,
        "RUNNING": 1,
        "QUEUED": 1,
    }
    listed = api.client.get(SWEEPS, headers=alice).json()["items"][0]
    assert listed["best"] == trials[best] and listed["trial_counts"] == sweep["trial_counts"]

    # A running sweep is only asked to cancel: the controller cancels its trials.
    cancelled = api.client.post(f"{SWEEPS}/{sweep_id}/cancel", headers=alice).json()
    assert cancelled["state"] == "RUNNING" and cancelled["cancel_requested"] is True


def test_openapi_lists_the_sweep_routes(api: Api) -> None:
    paths = api.client.get("/api/v1/openapi.json").json()["paths"]
    assert {f"{SWEEPS}", f"{SWEEPS}/{{sweep_id}}", f"{SWEEPS}/{{sweep_id}}/cancel"} <= set(paths)

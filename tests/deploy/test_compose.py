"""The laptop deployment, checked offline: docker-compose.yml against the Compose
specification's schema (and `docker compose config` where a Docker client with compose is
present), what its services promise, and the image's Dockerfile and entrypoint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shoal.service.devicespec import parse_devices

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
SHOAL_SERVICES = ("ray-head", "ray-fast", "ray-spot", "control-plane")


def compose() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return spec


def schema_check(path: Path) -> subprocess.CompletedProcess[str]:
    checker = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_compose_file_follows_the_compose_specification(tmp_path: Path) -> None:
    checked = schema_check(COMPOSE)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The check can fail: a misspelled key is refused.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_perod:"))
    assert schema_check(broken).returncode != 0


def test_docker_compose_config_accepts_it_where_compose_is_installed() -> None:
    docker = shutil.which("docker")
    present = (
        docker is not None
        and not subprocess.run([docker, "compose", "version"], capture_output=True).returncode
    )
    if not present:
        pytest.skip("no docker compose client here; the schema check stands in for it")
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_every_shoal_service_shares_the_image_and_the_checkpoint_volume() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", *SHOAL_SERVICES}
    for name in SHOAL_SERVICES:
        service = services[name]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile", name
        assert service["image"] == "${SHOAL_IMAGE:-shoal:0.1.0}", name
        env = service["environment"]
        assert env["SHOAL_CHECKPOINT_ROOT"] == "/checkpoints", name
        assert "checkpoints:/checkpoints" in service["volumes"], name
        assert env["RAY_ADDRESS"] == "ray-head:6379", name
    assert set(compose()["volumes"]) == {"pgdata", "checkpoints", "shoal-home"}


def test_only_the_control_plane_is_published_and_it_waits_for_its_dependencies() -> None:
    services = compose()["services"]
    assert [name for name, s in services.items() if "ports" in s] == ["control-plane"]
    plane = services["control-plane"]
    assert plane["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "ray-head": {"condition": "service_healthy"},
    }
    url = plane["environment"]["SHOAL_DATABASE_URL"]
    assert re.fullmatch(
        r"postgresql\+psycopg://shoal:\$\{SHOAL_DB_PASSWORD:-[^}]+\}@postgres:5432/shoal", url
    )
    assert services["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]


def test_the_worker_nodes_declare_two_kinds_one_spot_and_slowed_and_drain_on_stop() -> None:
    services = compose()["services"]
    groups = {}
    for name in ("ray-fast", "ray-spot"):
        command = services[name]["command"]
        assert command[:2] == ["shoal", "node"] and command[3:] == ["--address", "ray-head:6379"]
        (groups[name],) = parse_devices(command[2])  # one node each, a valid device group
    fast, spot = groups["ray-fast"], groups["ray-spot"]
    assert (fast.kind, fast.spot, fast.slowdown) == ("cpu-fast", False, 1.0)
    assert (spot.kind, spot.spot, spot.slowdown) == ("cpu-slow", True, 2.0)
    grace = services["ray-spot"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= 60  # time to drain on SIGTERM


def test_the_image_runs_as_a_user_with_a_healthcheck_and_installs_as_the_readme_does() -> None:
    text = DOCKERFILE.read_text()
    final = text[text.rindex("\nFROM ") :]  # the runtime stage
    user = re.findall(r"^USER (\S+)$", final, re.MULTILINE)
    assert user == ["shoal"] and "--uid 1000" in final
    assert re.search(
        r"^HEALTHCHECK .*\n\s+CMD \[\"shoal-entrypoint\", \"healthcheck\"\]", final, re.M
    )
    assert 'ENTRYPOINT ["shoal-entrypoint"]' in final and 'CMD ["control-plane"]' in final
    # The README's (Makefile's) steps: the same torch first, then the project.
    makefile = (ROOT / "Makefile").read_text()
    (torch,) = re.findall(r"^TORCH_SPEC \?= (\S+)$", makefile, re.MULTILINE)
    assert f"ARG TORCH_SPEC={torch}" in text
    assert text.index('pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"') < text.index(
        "pip install /src"
    )
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which is missing"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {"api", "service", "scheduler", "workers", "deploy", "pyproject.toml"} & set(ignored)


def make_install(tmp_path: Path, *settings: str) -> list[str]:
    """The commands ``make`` runs to install a new venv at ``tmp_path`` (printed, not run)."""
    venv = tmp_path / "venv"
    out = subprocess.run(
        ["make", "-n", f"VENV={venv}", *settings, f"{venv}/.shoal-installed"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.replace("\\\n", " ").splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_installs_torch_first_from_the_index_asked_and_keeps_one_already_there(
    tmp_path: Path,
) -> None:
    """The README's set-up: torch installed only where the venv has none, from the index
    asked for (pip's own by default), before the project, whose torch range the README says."""
    default = make_install(tmp_path)
    (torch,) = [c for c in default if '"torch==' in c]
    assert re.search(r'python -c "import torch" 2>/dev/null \|\|\s+\S+/pip install', torch), torch
    assert "--index-url" not in torch, torch
    project = default.index(next(c for c in default if 'install --quiet -e ".[test]"' in c))
    assert default.index(torch) < project, default
    cpu = "https://download.pytorch.org/whl/cpu"
    (torch,) = [c for c in make_install(tmp_path, f"TORCH_INDEX_URL={cpu}") if '"torch==' in c]
    assert f'--index-url "{cpu}" "torch==2.13.0"' in torch, torch
    pinned = re.findall(r'"torch>=(\d+\.\d+),<(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    ((low, major, minor),) = pinned
    readme = (ROOT / "README.md").read_text()
    assert f"(torch {low} to {major}.{int(minor) - 1})" in readme, pinned


def test_the_entrypoint_is_valid_shell_and_offers_the_modes_the_deployments_use() -> None:
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(ENTRYPOINT)], check=True)
    modes = re.findall(r"^([\w*-]+)\)$", ENTRYPOINT.read_text(), re.MULTILINE)
    assert modes == ["control-plane", "healthcheck", "*"]
    assert compose()["services"]["control-plane"]["command"] == ["control-plane"]

"""docker-compose.yml needs exactly the variables the README's Docker section (and .env.example) sets,
and each profile starts one worker flavour with every dependency satisfied (Docker does not run here,
so the file is checked the way compose interpolates and resolves it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}
VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
COMPOSE_OWN = {"COMPOSE_PROFILES"}  # read by compose itself, not interpolated


def _env_example() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            pairs[name.strip()] = value
    return pairs


def _docker_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]


def _interpolate(text: str, env: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        value = env.get(name)
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise KeyError(f"compose would stop: {name}: {arg}")
        if op in (":-", "-") and (value is None or (op == ":-" and value == "")):
            return arg
        return value or ""

    return VAR.sub(one, text)


def _resolve(node: Any, env: dict[str, str]) -> Any:
    """Interpolate every string value, as compose does after parsing the YAML."""
    if isinstance(node, dict):
        return {key: _resolve(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolve(value, env) for value in node]
    return _interpolate(node, env) if isinstance(node, str) else node


def _services(env: dict[str, str]) -> dict[str, Any]:
    doc = _resolve(yaml.safe_load(COMPOSE.read_text()), env)
    profiles = {p for p in env.get("COMPOSE_PROFILES", "").split(",") if p}
    return {n: s for n, s in doc["services"].items() if not s.get("profiles") or profiles & set(s["profiles"])}


def test_required_variables_are_exactly_what_the_docker_section_sets() -> None:
    used = {m["name"]: m["op"] for m in VAR.finditer(COMPOSE.read_text())}
    required = {name for name, op in used.items() if op in (":?", "?")}
    example = _env_example()
    assert required == {"FLOWER_PASSWORD", "FLEET_API_KEYS", "GRAFANA_ADMIN_PASSWORD"}
    assert set(example) - COMPOSE_OWN == set(used)  # .env.example sets every variable compose uses, no other
    section = _docker_section()
    assert "cp .env.example .env" in section
    for name in required:  # the section names each one where the command is
        assert name in section


def test_the_docker_section_commands_work_with_the_env_example() -> None:
    env = _env_example()
    services = _services(env)
    assert json.loads(services["api"]["environment"]["FLEET_API__API_KEYS"]) == ["change-me"]
    assert json.loads(services["flower"]["environment"]["FLEET_FLOWER__BASIC_AUTH"]) == ["fleet:change-me"]
    with pytest.raises(KeyError, match="FLEET_API_KEYS"):
        _services({k: v for k, v in env.items() if k != "FLEET_API_KEYS"})


CPU_WORKERS = {"worker", "worker-llama", "worker-encoder"}  # one per configured model (test_compose_models.py)
GPU_WORKERS = {"worker-gpu", "worker-gpu-llama", "worker-gpu-encoder"}


@pytest.mark.parametrize(("profiles", "workers"), [("cpu", CPU_WORKERS), ("gpu", GPU_WORKERS),
                                                   ("cpu,gpu", CPU_WORKERS | GPU_WORKERS)])
def test_each_profile_starts_its_worker_flavour_and_every_dependency(profiles: str, workers: set[str]) -> None:
    services = _services({**_env_example(), "COMPOSE_PROFILES": profiles})
    assert {n for n in services if n.startswith("worker")} == workers
    for name, service in services.items():
        deps = service.get("depends_on") or {}
        for dep, spec in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            assert dep in services or spec.get("required") is False, f"{name} needs {dep}, not started"


@pytest.mark.parametrize("dockerfile", ["deploy/Dockerfile.cpu", "deploy/Dockerfile.gpu"])
def test_every_package_the_project_installs_is_copied_into_the_images(dockerfile: str) -> None:
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    text = (ROOT / dockerfile).read_text()
    for pattern in packages["include"]:
        name = pattern.rstrip("*")
        assert f"COPY {name} {name}" in text, f"{dockerfile} does not copy package {name}/ (pip install . drops it)"


def test_the_cpu_image_installs_the_versions_ci_tested() -> None:
    """The worker overrides kombu internals (broker/versions.py refuses an untested kombu): the image
    installs from the lock file CI installs from, so a rebuilt image does not pull a newer kombu."""
    text = (ROOT / "deploy/Dockerfile.cpu").read_text()
    assert "constraints.txt" in text.split("RUN pip install", 1)[0]
    assert "pip install -c constraints.txt ." in text

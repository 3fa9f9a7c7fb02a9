"""Every model that docker compose's config (FLEET_CONFIG, configs/fleet.yaml in the image) configures
has a worker service in each worker profile, so `docker compose up` brings a fleet the gateway's /readyz
calls ready (>= 1 ready worker per configured model). Docker does not run here: the file is parsed the
way compose merges it, each `fleet ...` command is parsed with the real `fleet` CLI parser, and each
worker's settings are loaded from the real config with the service's own environment."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from producer.cli import build_parser
from protocol.settings import FleetSettings, load_settings
from tools.artifacts import model_path
from tools.build_model import KINDS, PRESETS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
IMAGE_ROOT = "/app"  # WORKDIR of deploy/Dockerfile.*; the images COPY configs/ there
IMAGE_CONFIG = f"{IMAGE_ROOT}/configs/fleet.yaml"  # their ENV FLEET_CONFIG
PROFILES = ("cpu", "gpu")
K8S = ROOT / "deploy" / "k8s"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # YAML merge keys (<<) resolved, as compose does
    return doc


def _in_profile(profile: str) -> dict[str, Any]:
    return {name: service for name, service in _compose()["services"].items()
            if not service.get("profiles") or profile in service["profiles"]}


def _parsed(command: list[str]) -> argparse.Namespace:
    assert command[0] == "fleet", command
    return build_parser().parse_args(command[1:])


def _settings_of(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> FleetSettings:
    """The settings a process of compose ``service`` loads: its environment, FLEET_CONFIG mapped into this checkout."""
    return _settings_with({key: str(value) for key, value in service["environment"].items()}, monkeypatch)


def _settings_with(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> FleetSettings:
    """The settings a container with environment ``env`` loads (FLEET_CONFIG, else the images' own, mapped
    into this checkout), nothing else of this process's FLEET_* variables."""
    env = dict(env)
    image_config = env.pop("FLEET_CONFIG", IMAGE_CONFIG)
    assert image_config.startswith(f"{IMAGE_ROOT}/"), image_config
    for key in [k for k in os.environ if k.startswith("FLEET_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_settings(ROOT / image_config.removeprefix(f"{IMAGE_ROOT}/"))


def _workers(profile: str) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in _in_profile(profile).items()
            if service.get("command", [None, None])[:2] == ["fleet", "worker"]}


def test_the_images_hold_the_config_where_compose_points() -> None:
    for dockerfile in ("deploy/Dockerfile.cpu", "deploy/Dockerfile.gpu"):
        text = (ROOT / dockerfile).read_text()
        assert f"WORKDIR {IMAGE_ROOT}" in text and "COPY configs configs" in text, dockerfile
        assert f"FLEET_CONFIG={IMAGE_CONFIG}" in text, dockerfile


@pytest.mark.parametrize("profile", PROFILES)
def test_every_configured_model_has_a_worker_in_each_profile(profile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    workers = _workers(profile)
    assert workers, f"profile {profile} starts no worker"
    served: dict[str, str] = {}
    for name, service in workers.items():
        settings = _settings_of(service, monkeypatch)
        model = settings.model_key(_parsed(service["command"]).model)  # raises UnknownModel if not configured
        assert model not in served, f"{name} and {served[model]} both serve {model}"
        served[model] = name
        assert profile in service["profiles"], name
        concurrency = _parsed(service["command"]).concurrency
        assert concurrency >= settings.models[model].batching.max_batch_size, f"{name}: C < max_batch_size"
        if profile == "gpu":  # a GPU worker never serves on a silent CPU fallback
            assert settings.models[model].engine.require_provider == "CUDAExecutionProvider", name
            assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"], name
    assert set(served) == set(settings.models), f"profile {profile}: models without a worker: " \
        f"{sorted(set(settings.models) - set(served))}"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_fleet_command_parses_with_the_real_cli(profile: str) -> None:
    for name, service in _in_profile(profile).items():
        command = service.get("command")
        if isinstance(command, list) and command[:1] == ["fleet"]:
            assert callable(_parsed(command).func), name


def test_the_models_service_builds_every_configured_model_file(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _compose()["services"]
    args = _parsed(services["models"]["command"])
    volume = next(v.split(":")[1] for v in services["models"]["volumes"] if v.startswith("models:"))
    assert Path(volume) == args.out_dir, "the models service builds into its models volume"
    kinds = KINDS if args.kind == "all" else (args.kind,)
    built = {model_path(args.out_dir, PRESETS[args.preset][kind]["name"], args.version or "1.0.0") for kind in kinds}
    settings = _settings_of(services["worker"], monkeypatch)
    for model, cfg in settings.models.items():  # the config's paths, as the image sees them
        in_image = Path(IMAGE_ROOT) / Path(cfg.path).resolve().relative_to(ROOT)
        assert in_image in built, f"{model}: {in_image} is not built by the models service"


@pytest.mark.parametrize("profile", PROFILES)
def test_prometheus_scrapes_every_worker_service(profile: str) -> None:
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "fleet-worker")
    names = {n for sd in job["dns_sd_configs"] for n in sd["names"]}
    assert set(_workers(profile)) <= names
    depends = _compose()["services"]["prometheus"]["depends_on"]
    assert set(_workers(profile)) <= set(depends)


@pytest.mark.parametrize("manifest", ["worker-cpu.yaml", "worker-gpu.yaml"])
def test_every_configured_model_has_a_kubernetes_worker_deployment(manifest: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for deploy/k8s: the gateway there uses the images' config, so each of its models needs a
    worker Deployment of each flavour (and KEDA a ScaledObject for it: tests/unit/test_k8s_manifests.py)."""
    deployments = [d for d in yaml.safe_load_all((K8S / manifest).read_text()) if d and d["kind"] == "Deployment"]
    served: dict[str, str] = {}
    for deployment in deployments:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        settings = _settings_with({e["name"]: e["value"] for e in container["env"]}, monkeypatch)
        model = settings.model_key(_parsed(container["command"]).model)
        assert model not in served, f"{deployment['metadata']['name']} and {served[model]} both serve {model}"
        served[model] = deployment["metadata"]["name"]
        assert deployment["spec"]["template"]["metadata"]["labels"]["model"] == model
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert f"--worker {model}@" in container[probe]["exec"]["command"][-1], (model, probe)
        if manifest == "worker-gpu.yaml":
            assert settings.models[model].engine.require_provider == "CUDAExecutionProvider", model
    assert set(served) == set(settings.models), f"{manifest}: models without a worker: " \
        f"{sorted(set(settings.models) - set(served))}"

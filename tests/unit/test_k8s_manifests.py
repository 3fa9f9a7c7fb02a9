"""deploy/k8s validates offline: every Kubernetes object against the official schemas that the
kubernetes-validate wheel ships (strict: unknown fields fail), the kustomization's resources exist,
and each KEDA ScaledObject points at a worker Deployment and its model's Celery queue."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _core(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"] != "keda.sh/v1alpha1"


@pytest.mark.parametrize(("name", "doc"), [d for d in _docs() if _core(d[1])],
                         ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_every_object_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_catches_a_misspelt_field() -> None:
    deployment = next(d for _, d in _docs() if d["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicaz"] = broken["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_files_that_exist_and_every_base_object_once() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    optional = {"worker-gpu.yaml", "keda-worker-gpu.yaml"}  # added by hand where GPUs exist (see the comment)
    assert {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} == set(kustomization["resources"]) | optional


def test_scaled_objects_scale_worker_deployments_on_their_model_queue() -> None:
    docs = _docs()
    deployments = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Deployment"}
    scaled = [d for _, d in docs if d["kind"] == "ScaledObject"]
    assert len(scaled) == 2
    for obj in scaled:
        spec = obj["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        model = target["spec"]["template"]["metadata"]["labels"]["model"]
        command = target["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[:4] == ["fleet", "worker", "--model", model]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1  # activation from zero
        redis_trigger = next(t for t in spec["triggers"] if t["type"] == "redis")
        assert redis_trigger["metadata"]["listName"] == f"fleet.{model}"  # settings.queue_for(model)
        assert int(redis_trigger["metadata"]["listLength"]) >= 1
        assert redis_trigger["metadata"]["activationListLength"] == "0"
        held = next(t for t in spec["triggers"] if t["type"] == "prometheus")["metadata"]["query"]
        assert f'fleet_queue_depth{{model="{model}"}}' in held and f'fleet_worker_in_flight{{model="{model}"}}' in held
        assert target["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60

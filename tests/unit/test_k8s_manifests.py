"""k8s/ manifests satisfy the KubeRay CRD schemas (shared/kuberay-crds), as the operator would check them."""

from __future__ import annotations

import os
import shlex
from functools import lru_cache
from pathlib import Path
from unittest.mock import patch

import jsonschema
import pytest
import yaml

from helpers import ROOT

# beside the checkout, as in CI; or the workplace's shared folder, for a checkout (a worktree) elsewhere
CRDS = next((p for p in (ROOT.parent / "shared" / "kuberay-crds", Path("/work/shared/kuberay-crds")) if p.exists()),
            None)
if CRDS is None and os.environ.get("CI"):  # CI has them: their absence there is a broken checkout, not a skip
    raise FileNotFoundError("CI=true but no shared/kuberay-crds beside the checkout: the manifests go unchecked")
pytestmark = pytest.mark.skipif(CRDS is None, reason="needs shared/kuberay-crds beside the checkout (CI has them)")
MANIFESTS = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "k8s").glob("*.yaml"))}


@lru_cache
def crd_validator(kind: str) -> jsonschema.Validator:
    """The CRD's v1 schema as a validator, read once per kind: each CRD is ~1 MB of YAML (libyaml reads it in 0.5 s,
    PyYAML's Python reader in 3.5 s) and the operator's own schema needs no metaschema check before every use."""
    crd = yaml.load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=yaml.CSafeLoader)
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft202012Validator(v1["schema"]["openAPIV3Schema"])


def cluster_spec(doc: dict) -> dict:
    return {"RayCluster": lambda: doc["spec"], "RayJob": lambda: doc["spec"]["rayClusterSpec"],
            "RayService": lambda: doc["spec"]["rayClusterConfig"]}[doc["kind"]]()


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_the_kuberay_crd(name):
    doc = MANIFESTS[name]
    assert doc["apiVersion"] == "ray.io/v1"
    crd_validator(doc["kind"]).validate(doc)


def test_one_of_each_kind():
    assert sorted(doc["kind"] for doc in MANIFESTS.values()) == ["RayCluster", "RayJob", "RayService"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_cpu_and_gpu_worker_groups_share_the_run_volume(name):
    spec = cluster_spec(MANIFESTS[name])
    groups = {g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    [gpu] = groups["gpu"]["containers"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["authOptions"] == {"mode": "token"}
    for pod in [spec["headGroupSpec"]["template"]["spec"], *groups.values()]:  # the driver's and the learner's
        [container] = pod["containers"]
        assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]


def test_the_job_trains_into_the_shared_volume_and_a_retry_goes_on_there():
    from lightning_ray.config import compose, loopback

    spec = MANIFESTS["rayjob.yaml"]["spec"]
    program, *overrides = shlex.split(spec["entrypoint"].removeprefix("python "))  # as the head's shell would
    with patch.dict(os.environ, {"LIGHTNING_RAY_API_KEY": "a key"}):  # the Secret's, in every pod
        cfg = compose(overrides)  # the config the job would run with
    assert program == "jobs/train.py" and cfg.ray.address == "auto"
    assert cfg.run_path.parent == Path("/runs") and cfg.resume == "auto" and spec["backoffLimit"] > 0
    # the driver resolves the model on the head and hands the path to pods of their own: a path they all read
    assert Path(cfg.model.cache_dir).is_relative_to("/runs")
    # a rollout worker on a pod without a replica reaches the replicas on the pods' network (with direct ingress
    # Serve runs its proxy on the head only), with the key
    assert not loopback(cfg.serve.host) and cfg.serve.api_key == "a key"


@pytest.mark.parametrize("name", ["rayjob.yaml", "raycluster.yaml"])
def test_every_node_of_a_training_cluster_downloads_to_the_shared_volume_and_lets_rollouts_skip_the_proxy(name):
    """A Hub model downloaded by the driver on the head must be where the replicas and the learner on other pods look;
    rollout workers on a pod without a replica have no Serve proxy there, so they call the replicas' own ports
    (Serve's direct ingress, which a local cluster of the run turns on by itself)."""
    from lightning_ray.serving.routing import DIRECT_INGRESS

    spec = cluster_spec(MANIFESTS[name])
    for pod in [spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"])]:
        [container] = pod["containers"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
        assert Path(env.get("HF_HOME", "~")).is_relative_to("/runs") and DIRECT_INGRESS.items() <= env.items()
        # the callers' key, from its Secret; and a component given no GPU sees none (as on a run's local cluster)
        assert env["LIGHTNING_RAY_API_KEY"] == {"secretKeyRef": {"name": "lightning-ray-api-key", "key": "api_key"}}
        assert env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "1"


def test_the_gpu_image_runs_the_python_of_the_head():
    """Ray refuses a node whose Python differs from the head's: the GPU image's documented base and the CPU
    image's default name the same pyXY."""
    import re

    dockerfile = (ROOT / "k8s" / "Dockerfile").read_text()
    [cpu] = re.findall(r"^ARG BASE=\S+-(py\d+)-cpu$", dockerfile, re.M)
    [gpu] = re.findall(r"--build-arg BASE=\S+-(py\d+)-gpu", dockerfile)
    assert cpu == gpu


def test_the_service_deploys_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(MANIFESTS["rayservice.yaml"]["spec"]["serveConfigV2"]))
    [app] = config.applications
    assert app.import_path == "jobs.serve:app"
    assert any(o.startswith("model.path=/runs/") for o in app.args["overrides"])


def test_a_broken_manifest_is_caught():
    doc = yaml.safe_load((ROOT / "k8s" / "rayjob.yaml").read_text())
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        crd_validator("RayJob").validate(doc)

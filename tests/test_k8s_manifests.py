"""k8s/ manifests satisfy the KubeRay CRD schemas (../shared/kuberay-crds), as the operator would check them."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "kuberay-crds"
pytestmark = pytest.mark.skipif(not CRDS.exists(), reason="needs ../shared/kuberay-crds beside the checkout, as in CI")


def crd_schema(kind: str) -> dict:
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("manifest", sorted((ROOT / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_matches_the_kuberay_crd(manifest):
    doc = yaml.safe_load(manifest.read_text())
    assert doc["apiVersion"] == "ray.io/v1"
    jsonschema.validate(doc, crd_schema(doc["kind"]))
    if doc["kind"] == "RayJob":
        assert doc["spec"]["entrypoint"].startswith("python jobs/train.py")
        assert "ray.address=auto" in doc["spec"]["entrypoint"]


def test_a_broken_manifest_is_caught():
    doc = yaml.safe_load((ROOT / "k8s" / "rayjob.yaml").read_text())
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, crd_schema("RayJob"))

"""The cluster configurations in cluster/ are valid: the AWS and GCP cluster-launcher YAMLs through Ray's
own config preparation and schema validation (what `ray up` runs before touching a cloud), the KubeRay
RayJob through a JSON schema of the RayJob fields it uses plus raytrainer's rules (secrets only from
Kubernetes secrets, token auth on every Ray container, the entrypoint's arguments parse)."""

from __future__ import annotations

import copy
import os
import shlex

import jsonschema
import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, "cluster", name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cluster_launcher_configs_pass_rays_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load(name)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"
    assert prepared["available_node_types"]["head"]["resources"] == {"CPU": 0}
    assert all("RAY_AUTH_MODE=token" in " ".join(prepared[k]) for k in ("head_start_ray_commands",
                                                                          "worker_start_ray_commands"))
    assert prepared["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    # the validation is real: a misspelt field is rejected
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["max_wrokers"] = 2
    with pytest.raises(jsonschema.ValidationError, match="max_wrokers"):
        validate_config(prepare_config(broken))


_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_ENV_VAR = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "value": {"type": "string"}, "valueFrom": {
        "type": "object", "properties": {"secretKeyRef": {"type": "object", "required": ["name", "key"]}}}},
}
_CONTAINER = {
    "type": "object", "required": ["name", "image"],
    "properties": {"name": {"type": "string"}, "image": {"type": "string"},
                   "env": {"type": "array", "items": _ENV_VAR}},
}
_POD = {"type": "object", "required": ["spec"], "properties": {"spec": {
    "type": "object", "required": ["containers"],
    "properties": {"containers": {"type": "array", "minItems": 1, "items": _CONTAINER}}}}}
RAYJOB_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["entrypoint", "rayClusterSpec"],
                 "additionalProperties": False,
                 "properties": {
                     "entrypoint": {"type": "string"}, "runtimeEnvYAML": {"type": "string"},
                     "shutdownAfterJobFinishes": {"type": "boolean"},
                     "ttlSecondsAfterFinished": {"type": "integer"},
                     "activeDeadlineSeconds": {"type": "integer"}, "backoffLimit": {"type": "integer"},
                     "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode"]},
                     "submitterPodTemplate": _POD,
                     "rayClusterSpec": {
                         "type": "object", "required": ["headGroupSpec"], "additionalProperties": False,
                         "properties": {
                             "rayVersion": {"type": "string"},
                             "headGroupSpec": {"type": "object", "required": ["rayStartParams", "template"],
                                               "properties": {"rayStartParams": _STR_MAP, "template": _POD}},
                             "workerGroupSpecs": {"type": "array", "items": {
                                 "type": "object", "additionalProperties": False,
                                 "required": ["groupName", "replicas", "rayStartParams", "template"],
                                 "properties": {"groupName": {"type": "string"},
                                                "replicas": {"type": "integer", "minimum": 0},
                                                "minReplicas": {"type": "integer", "minimum": 0},
                                                "maxReplicas": {"type": "integer", "minimum": 0},
                                                "rayStartParams": _STR_MAP, "template": _POD}}}}}}},
    },
}


def _containers(job: dict) -> list[dict]:
    spec = job["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]
    return [c for pod in pods for c in pod["spec"]["containers"]]


def test_kuberay_rayjob_manifest():
    from raytrainer import ArgumentParser, TrainingArguments

    job = _load("kuberay-rayjob.yaml")
    jsonschema.validate(job, RAYJOB_SCHEMA)
    for container in _containers(job):
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        for secret in ("RAY_AUTH_TOKEN", "HF_TOKEN"):  # from Kubernetes secrets, never a literal value
            assert "value" not in env[secret] and env[secret]["valueFrom"]["secretKeyRef"]["name"]
        assert container["image"].startswith(f"rayproject/ray:{job['spec']['rayClusterSpec']['rayVersion']}-")
    assert "TOKEN" not in job["spec"]["runtimeEnvYAML"].upper()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "examples/train_digits.py"]
    (args,) = ArgumentParser(TrainingArguments).parse_args_into_dataclasses([*argv[2:], "--output_dir", "x"])
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert args.use_gpu and args.num_workers <= workers["replicas"] * gpus
    # the schema check is real: a misplaced field is rejected
    broken = copy.deepcopy(job)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYJOB_SCHEMA)

"""The chart's part of issue 18: the node-local endpoint in the cache worker
DaemonSet, the training pod snippet, the Flight Service and NetworkPolicy, and
the example PyTorchJob, rendered by the real Helm engine and validated
strictly against the Kubernetes schema."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.test_chart import CHART, K8S_VERSION, objects, render

pytest.importorskip("helm_python")
pytestmark = pytest.mark.helm

ENDPOINT = yaml.safe_load((CHART / "ci" / "endpoint-values.yaml").read_text())
SCRIPT = CHART / "examples" / "torchrun_train.py"


def _one(objs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    found = [
        o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)
    ]
    assert len(found) == 1, (kind, suffix, [o["metadata"]["name"] for o in objs])
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _validate_pod(spec: dict[str, Any]) -> None:
    import kubernetes_validate

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_endpoint_is_not_rendered_by_default():
    objs = objects()
    ds = _one(objs, "DaemonSet", "-shard")
    pod = ds["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert pod["containers"][0]["command"][:3] == ["ray", "start", "--block"]
    assert not [
        o for o in objs if o["metadata"]["name"].endswith(("-flight", "-training-pod"))
    ]


def test_daemonset_runs_endpoint_beside_raylet_with_socket_and_memory_when_endpoint_enabled_set():
    ds = _one(objects(ENDPOINT), "DaemonSet", "-shard")
    pod = ds["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    # One container: the raylet, then the endpoint as a driver beside it.
    assert worker["command"][:2] == ["sh", "-c"]
    script = worker["command"][2]
    assert script.startswith("ray start ") and "--block" not in script
    assert script.endswith("&& exec python -m shardcache_server.endpoint")
    env = _env(worker)
    assert (
        env["SHARDCACHE_ENDPOINT_SOCKET"]["value"]
        == "/var/run/shardcache/endpoint.sock"
    )
    assert env["SHARDCACHE_ENDPOINT_SHM_BYTES"]["value"] == "8589934592"
    assert env["SHARDCACHE_RAY_ADDRESS"]["value"] == "rel-shardcache-ray-head:6379"
    assert (
        env["SHARDCACHE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "spec.nodeName"
    )
    assert env["SHARDCACHE_FLIGHT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == (
        "rel-shardcache-flight-token"
    )
    assert (
        env["SHARDCACHE_FLIGHT_TLS_CERT"]["value"]
        == "/etc/shardcache/flight-tls/tls.crt"
    )
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["endpoint-socket"]["hostPath"] == {
        "path": "/var/run/shardcache", "type": "DirectoryOrCreate"
    }  # fmt: skip
    assert volumes["endpoint-shm"]["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": 8589934592,
    }
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["endpoint-shm"] == env["SHARDCACHE_ENDPOINT_SHM_DIR"]["value"]
    assert {"name": "flight", "containerPort": 8815} in worker["ports"]
    assert {"name": "stream", "containerPort": 8816} in worker["ports"]
    # The kubelet creates the hostPath root-owned; only CHOWN, only for it.
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "1000:1000", "/var/run/shardcache"]
    assert init["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["CHOWN"],
    }


def test_endpoint_settings_the_chart_sets_are_accepted_by_the_endpoint():
    from shardcache_server.endpoint import EndpointSettings

    ds = _one(objects(ENDPOINT), "DaemonSet", "-shard")
    values = {
        name.removeprefix("SHARDCACHE_").lower(): e["value"]
        for name, e in _env(ds["spec"]["template"]["spec"]["containers"][0]).items()
        if name.startswith("SHARDCACHE_") and "value" in e and "$(" not in e["value"]
    }
    settings = EndpointSettings(**values)
    assert settings.endpoint_socket_mode == 0o666
    assert settings.flight_port == 8815 and settings.stream_port == 8816


def test_training_pod_snippet_is_a_valid_pod_and_names_the_socket_when_endpoint_enabled_set():
    from shardcache.config import ClientConfig

    cm = _one(objects(ENDPOINT), "ConfigMap", "-training-pod")
    snippet = yaml.safe_load(cm["data"]["pod-snippet.yaml"])
    snippet["containers"][0]["image"] = "my-training-image:1"
    _validate_pod(snippet)
    env = _env(snippet["containers"][0])
    socket = env["SHARDCACHE_ENDPOINT"]["value"]
    mount = next(
        m for m in snippet["containers"][0]["volumeMounts"]
        if m["name"] == "shardcache-endpoint"
    )  # fmt: skip
    assert mount["readOnly"] is True and socket.startswith(mount["mountPath"] + "/")
    # The TCP stream, chosen over Flight by measurement (BENCHMARKS.md).
    assert env["SHARDCACHE_REMOTE_URL"]["value"] == (
        "tls://rel-shardcache-flight.cache.svc:8816"
    )
    # Every plain setting of the snippet is one the SDK reads.
    plain = {
        k.removeprefix("SHARDCACHE_").lower(): e["value"]
        for k, e in env.items()
        if "value" in e
    }
    config = ClientConfig(**plain)
    assert config.endpoint == socket and config.remote_ca


def test_flight_service_and_network_policy_open_only_the_streaming_port_when_flight_enabled_set():
    objs = objects(ENDPOINT)
    svc = _one(objs, "Service", "-flight")
    assert svc["spec"]["ports"] == [
        {"name": "flight", "port": 8815, "targetPort": "flight", "protocol": "TCP"},
        {"name": "stream", "port": 8816, "targetPort": "stream", "protocol": "TCP"},
    ]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "shard"
    pol = _one(objs, "NetworkPolicy", "-flight")
    (rule,) = pol["spec"]["ingress"]
    assert rule["ports"] == [
        {"port": 8815, "protocol": "TCP"},
        {"port": 8816, "protocol": "TCP"},
    ]
    namespaces = {
        s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for s in rule["from"]
        if "namespaceSelector" in s
    }
    assert namespaces == {"training", "research"}
    token = _one(objs, "Secret", "-flight-token")
    assert set(token["data"]) == {"token"}


def test_stream_port_zero_serves_flight_only_and_the_snippet_names_flight():
    values = {**ENDPOINT, "endpoint": {**ENDPOINT["endpoint"]}}
    values["endpoint"]["flight"] = {**ENDPOINT["endpoint"]["flight"], "streamPort": 0}
    objs = objects(values)
    assert [p["name"] for p in _one(objs, "Service", "-flight")["spec"]["ports"]] == [
        "flight"
    ]
    (rule,) = _one(objs, "NetworkPolicy", "-flight")["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8815, "protocol": "TCP"}]
    ds = _one(objs, "DaemonSet", "-shard")
    worker = ds["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in worker["ports"]].count("stream") == 0
    assert _env(worker)["SHARDCACHE_STREAM_PORT"]["value"] == "0"
    cm = _one(objs, "ConfigMap", "-training-pod")
    env = _env(yaml.safe_load(cm["data"]["pod-snippet.yaml"])["containers"][0])
    assert env["SHARDCACHE_REMOTE_URL"]["value"] == (
        "grpc+tls://rel-shardcache-flight.cache.svc:8815"
    )


def test_example_pytorchjob_pods_are_valid_and_run_the_shipped_script():
    import importlib.util

    objs = objects(ENDPOINT)
    job = _one(objs, "PyTorchJob", "-torchrun-example")
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    assert job["spec"]["nprocPerNode"] == "4"
    cm = _one(objs, "ConfigMap", "-torchrun-example")
    assert cm["data"]["torchrun_train.py"] == SCRIPT.read_text()
    spec = importlib.util.spec_from_file_location("torchrun_example", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for role in ("Master", "Worker"):
        pod = specs[role]["template"]["spec"]
        _validate_pod(pod)
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        command = container["command"]
        assert command[0] == "torchrun"
        assert Path(command[1]).name == "torchrun_train.py"
        args = module.parse_args(command[2:])
        assert args.url == "s3://training-data/imagenet/train/"
        assert args.storage_options == {"endpoint_url": "http://minio.storage.svc:9000"}
        assert "SHARDCACHE_ENDPOINT" in _env(container)
        assert "SHARDCACHE_REDIS_URL" not in _env(container)  # no route to Redis needed
        assert shlex.join(command)  # a plain argv, no shell


@pytest.mark.parametrize(
    "values,match",
    [
        (
            {"endpoint": {"enabled": True}, "kuberay": {"enabled": True}},
            "kuberay.enabled=false",
        ),
        ({"endpoint": {"flight": {"enabled": True}}}, "endpoint.flight.enabled needs"),
        ({"examples": {"pyTorchJob": {"enabled": True}}}, "examples.pyTorchJob.url"),
    ],
)
def test_endpoint_values_fail_once_naming_the_missing_prerequisite(values, match):
    with pytest.raises(Exception, match=match):
        render(values)

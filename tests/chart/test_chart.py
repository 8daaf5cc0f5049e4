"""The Helm chart, rendered by the real Helm engine (helm-python-sdk), validated
against Kubernetes' OpenAPI schemas, and checked against the Python settings."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "shardcache"
K8S_VERSION = "1.35.0"
CRD_KINDS = {
    "PyTorchJob",
    "RayCluster",
    "RayJob",
    "ServiceMonitor",
}  # validated by their operators, not core OpenAPI; RayJob's structure below,
# PyTorchJob's pod templates in test_endpoint_chart.py

helm = pytest.importorskip("helm_python")
pytestmark = pytest.mark.helm


def render(values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name="rel", namespace="cache")
    docs: dict[str, list[dict[str, Any]]] = {}
    for path, text in out.items():
        if path.endswith(".txt"):
            docs[path] = [{"NOTES": text}]
            continue
        docs[path] = [d for d in yaml.safe_load_all(text) if d]
    return docs


def objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [
        d
        for path, ds in render(values).items()
        if not path.endswith(".txt")
        for d in ds
    ]


def ci_values() -> list[Path]:
    return sorted((CHART / "ci").glob("*.yaml"))


@pytest.mark.parametrize("values_file", ci_values(), ids=lambda p: p.stem)
def test_chart_renders_valid_kubernetes_objects_when_ci_values_set(values_file):
    import kubernetes_validate

    values = yaml.safe_load(values_file.read_text()) or {}
    objs = objects(values)
    assert objs
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_chart_lint_has_no_errors():
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    assert all(m["severity"] < 3 for m in result["messages"]), result["messages"]


def test_values_schema_is_generated_from_values_yaml():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_values_schema.py"), "--check"]
    )
    assert done.returncode == 0, (
        "run scripts/gen_values_schema.py after editing values.yaml"
    )


@pytest.mark.parametrize(
    "values_file", [CHART / "values.yaml", *ci_values()], ids=lambda p: p.stem
)
def test_values_files_satisfy_schema(values_file):
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load(values_file.read_text()) or {}, schema)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"cache": {"cacheBytes": -1}}, "cacheBytes"),
        ({"ray": {"objectStoreBytes": -5}}, "objectStoreBytes"),
        ({"cache": {"eviction": "fifo"}}, "eviction"),
        ({"unknownKey": 1}, "unknownKey"),
    ],
)
def test_values_schema_rejects_bad_values_with_readable_message(bad, match):
    with pytest.raises(Exception, match=match) as info:
        render(bad)
    assert "values don't meet the specifications" in str(info.value) or match in str(
        info.value
    )


def test_chart_validate_values_fails_once_with_all_messages():
    with pytest.raises(Exception, match="cacheBytes must not exceed") as info:
        render({"cache": {"cacheBytes": 2**40}, "redis": {"enabled": False}})
    assert "redis.external.existingSecret" in str(info.value)


def test_every_object_has_standard_labels_and_pods_roll_on_config_change():
    for obj in objects():
        labels = obj["metadata"].get("labels", {})
        for key in (
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/component",
            "app.kubernetes.io/managed-by",
            "helm.sh/chart",
        ):
            assert key in labels, (obj["kind"], obj["metadata"]["name"], key)
        if obj["kind"] in ("Deployment", "DaemonSet"):
            assert (
                "checksum/config" in obj["spec"]["template"]["metadata"]["annotations"]
            )


def test_containers_run_non_root_with_read_only_root_fs():
    for obj in objects():
        spec = obj.get("spec", {}).get("template", {}).get("spec") or (
            obj["spec"] if obj["kind"] == "Pod" else None
        )
        if not spec:
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_chart_settings_match_python_config():
    import typer.main

    from shardcache.config import ClientConfig
    from shardcache_server.cli import app
    from shardcache_server.endpoint import EndpointSettings
    from shardcache_server.settings import ServiceSettings

    known = {f"SHARDCACHE_{f.upper()}" for f in ServiceSettings.model_fields}
    known |= {f"SHARDCACHE_{f.upper()}" for f in EndpointSettings.model_fields}
    known |= {f"SHARDCACHE_{f.upper()}" for f in ClientConfig.model_fields}
    command = typer.main.get_command(app)
    for sub in command.commands.values():  # type: ignore[attr-defined]
        for param in sub.params:
            if getattr(param, "envvar", None):
                known.add(param.envvar)
    known.add(
        "SHARDCACHE_REDIS_PASSWORD"
    )  # only composes SHARDCACHE_REDIS_URL in the chart
    objs = objects()
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    assert set(config["data"]) <= known
    assert config["data"]["SHARDCACHE_CACHE_BYTES"] == "8589934592"
    assert config["data"]["SHARDCACHE_BUILD_WORKERS"] == "0"  # one per node CPU
    ServiceSettings(
        **{k.removeprefix("SHARDCACHE_").lower(): v for k, v in config["data"].items()}
    )
    endpoint_values = yaml.safe_load(
        (CHART / "ci" / "endpoint-values.yaml").read_text()
    )
    rendered = yaml.safe_dump_all(objs) + yaml.safe_dump_all(objects(endpoint_values))
    used = set(re.findall(r"SHARDCACHE_[A-Z_]+", rendered))
    assert used <= known, used - known
    # CLI entrypoints named by the chart exist.
    commands = set(command.commands)  # type: ignore[attr-defined]
    for obj in objs:
        spec = obj.get("spec", {}).get("template", {}).get("spec") or obj.get(
            "spec", {}
        )
        for c in spec.get("containers", []):
            cmd = c.get("command", [])
            if cmd and cmd[0] == "shardcache":
                assert cmd[1] in commands, cmd
    # The Redis URL the chart composes is one the client accepts.
    redis_env = [
        e for o in objs for e in _env(o) if e["name"] == "SHARDCACHE_REDIS_URL"
    ]
    url = redis_env[0]["value"].replace("$(SHARDCACHE_REDIS_PASSWORD)", "pw")
    ClientConfig(redis_url=url)


def _env(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec") or obj.get("spec", {})
    return [e for c in spec.get("containers", []) for e in c.get("env", [])]


def test_notes_tell_how_to_point_a_job_and_warn_without_token():
    notes = render()["shardcache/templates/NOTES.txt"][0]["NOTES"]
    assert (
        "SHARDCACHE_REDIS_URL" in notes
        and "port-forward" in notes
        and "RAY_AUTH_TOKEN" in notes
    )
    assert "WARNING" in notes
    with_token = render({"dashboard": {"tokenSecret": "t"}})[
        "shardcache/templates/NOTES.txt"
    ][0]["NOTES"]
    assert "WARNING" not in with_token


def test_kuberay_renders_raycluster_instead_of_daemonset_when_kuberay_enabled_set():
    kinds = {o["kind"] for o in objects({"kuberay": {"enabled": True}})}
    assert "RayCluster" in kinds and "DaemonSet" not in kinds


def test_external_redis_renders_no_statefulset_when_external_set():
    objs = objects(
        {"redis": {"enabled": False, "external": {"existingSecret": "team-redis"}}}
    )
    assert "StatefulSet" not in {o["kind"] for o in objs}
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for o in objs
        for e in _env(o)
        if "valueFrom" in e
        and e["valueFrom"].get("secretKeyRef", {}).get("name") == "team-redis"
    ]
    assert refs and all(r["key"] == "redis-url" for r in refs)


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] == "RayCluster":
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        return [g["template"]["spec"] for g in groups]
    return [spec.get("template", {}).get("spec") or spec]


@pytest.mark.parametrize("kuberay", [False, True])
def test_redis_ca_secret_is_mounted_wherever_redis_is_used(kuberay):
    external = {"existingSecret": "team-redis", "caSecret": "team-ca"}
    objs = objects(
        {
            "redis": {"enabled": False, "external": external},
            "kuberay": {"enabled": kuberay},
        }
    )
    users = 0
    for obj in objs:
        for pod in _pod_specs(obj):
            for c in pod.get("containers", []):
                if not any(
                    e["name"] == "SHARDCACHE_REDIS_URL" for e in c.get("env", [])
                ):
                    continue
                users += 1
                mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
                assert mounts["redis-ca"]["mountPath"] == "/etc/shardcache/redis-ca"
                assert mounts["redis-ca"]["readOnly"] is True
                volumes = {v["name"]: v for v in pod["volumes"]}
                assert volumes["redis-ca"]["secret"]["secretName"] == "team-ca"
    assert users >= 4  # Ray head, store controller, cache workers, dashboard
    plain = objects({"redis": {"enabled": False, "external": {"existingSecret": "r"}}})
    assert not any(
        v["name"] == "redis-ca"
        for o in plain
        for pod in _pod_specs(o)
        for v in pod.get("volumes", [])
    )


def test_network_policy_limits_ingress_to_own_pods_and_training_namespaces():
    pols = [
        o
        for o in objects({"networkPolicy": {"trainingNamespaces": ["ml"]}})
        if o["kind"] == "NetworkPolicy"
    ]
    assert {p["metadata"]["name"].rsplit("-", 1)[-1] for p in pols} >= {
        "redis",
        "shard",
        "dashboard",
        "head",
    }
    for p in pols:
        sources = p["spec"]["ingress"][0]["from"]
        assert any("namespaceSelector" in s for s in sources)


def test_no_secret_in_values_or_manifests_in_plain_text():
    text = yaml.safe_dump_all(objects())
    assert "AWS_SECRET_ACCESS_KEY:" not in text.replace(
        "key: AWS_SECRET_ACCESS_KEY", ""
    )


def test_dockerfiles_pass_hadolint_and_copy_existing_paths():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    files = sorted((ROOT / "docker").glob("*Dockerfile"))
    assert files
    done = subprocess.run([hadolint, *map(str, files)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for f in files:
        for line in f.read_text().splitlines():
            if line.startswith("COPY") and "--from" not in line:
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"{f.name}: COPY {src} does not exist"


RAYJOB_EXAMPLE = {
    "kuberay": {"enabled": True},
    "ray": {"head": {"jobSubmission": True}},
    "examples": {"rayJob": {"enabled": True, "url": "s3://data/train/"}},
}


def _by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _env_by_name(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_example_rayjob_is_not_rendered_by_default():
    for values in ({}, {"kuberay": {"enabled": True}}):
        objs = objects(values)
        assert not _by_kind(objs, "RayJob")
        assert not [o for o in objs if o["metadata"]["name"].endswith("-example")]


def test_example_rayjob_selects_chart_raycluster_when_examples_rayjob_enabled_set():
    objs = objects(RAYJOB_EXAMPLE)
    (job,) = _by_kind(objs, "RayJob")
    (cluster,) = _by_kind(objs, "RayCluster")
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    # An existing cluster: the cache's, selected by name, never deleted by the job.
    assert spec["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert "rayClusterSpec" not in spec
    assert spec["shutdownAfterJobFinishes"] is False
    assert spec["submissionMode"] == "K8sJobMode"
    # The head serves the Jobs API the submitter talks to.
    head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert head["include-dashboard"] == "true" and head["dashboard-host"] == "0.0.0.0"


def test_example_rayjob_entrypoint_and_runtime_env_run_the_shipped_script(
    ray_train_example,
):
    objs = objects(RAYJOB_EXAMPLE)
    (job,) = _by_kind(objs, "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "ray_train.py"]
    args = ray_train_example.parse_args(argv[2:])
    assert args.url == "s3://data/train/" and args.workers == 2
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert set(runtime_env) == {"working_dir"}  # no secret in the runtime env
    pod = job["spec"]["submitterPodTemplate"]["spec"]
    (submitter,) = pod["containers"]
    (mount,) = [m for m in submitter["volumeMounts"] if m["name"] == "script"]
    assert mount["mountPath"] == f"{runtime_env['working_dir']}/ray_train.py"
    assert mount["subPath"] == "ray_train.py" and mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == "script"]
    (config,) = [
        o
        for o in _by_kind(objs, "ConfigMap")
        if o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    assert (
        config["data"]["ray_train.py"] == Path(ray_train_example.__file__).read_text()
    )


def test_example_rayjob_submitter_is_a_valid_pod_with_the_ray_token():
    import kubernetes_validate

    objs = objects(RAYJOB_EXAMPLE)
    (job,) = _by_kind(objs, "RayJob")
    (cluster,) = _by_kind(objs, "RayCluster")
    template = job["spec"]["submitterPodTemplate"]
    kubernetes_validate.validate(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "submitter", **template["metadata"]},
            "spec": template["spec"],
        },
        K8S_VERSION,
        strict=True,
    )
    # The NetworkPolicies admit the cache's own pods by this label.
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    spec = template["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    (submitter,) = spec["containers"]
    assert submitter["securityContext"]["readOnlyRootFilesystem"] is True
    env = _env_by_name(submitter)
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    cluster_env = _env_by_name(
        cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    )
    assert (
        env["RAY_AUTH_TOKEN"]["valueFrom"] == cluster_env["RAY_AUTH_TOKEN"]["valueFrom"]
    )
    assert "SHARDCACHE_REDIS_PASSWORD" not in env  # the submitter never reads Redis


def test_example_rayjob_driver_and_ranks_get_redis_url_from_the_chart_secret():
    # The entrypoint runs on the head and the ranks in the cache worker pods;
    # Ray workers inherit those pods' env, which the chart fills from its Secret.
    objs = objects(RAYJOB_EXAMPLE)
    (cluster,) = _by_kind(objs, "RayCluster")
    secret = next(
        o for o in _by_kind(objs, "Secret") if "redis-password" in o.get("data", {})
    )
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        env = _env_by_name(group["template"]["spec"]["containers"][0])
        ref = env["SHARDCACHE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
        assert "$(SHARDCACHE_REDIS_PASSWORD)@" in env["SHARDCACHE_REDIS_URL"]["value"]
        assert env["RAY_AUTH_MODE"]["value"] == "token"


def test_example_rayjob_passes_s3_endpoint_when_s3_endpoint_url_set(
    ray_train_example,
):
    values = {**RAYJOB_EXAMPLE, "s3": {"endpointUrl": "http://minio:9000"}}
    (job,) = _by_kind(objects(values), "RayJob")
    args = ray_train_example.parse_args(shlex.split(job["spec"]["entrypoint"])[2:])
    assert args.storage_options == {"endpoint_url": "http://minio:9000"}


def test_example_rayjob_fails_once_naming_every_missing_prerequisite():
    with pytest.raises(Exception, match="kuberay.enabled=true") as info:
        render({"examples": {"rayJob": {"enabled": True}}})
    text = str(info.value)
    assert "ray.head.jobSubmission=true" in text and "examples.rayJob.url" in text


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"examples": {"rayJob": {"workers": 0}}}, "workers"),
        ({"examples": {"rayJob": {"url": "/local/path"}}}, "url"),
        ({"examples": {"rayJob": {"bogus": 1}}}, "bogus"),
    ],
)
def test_values_schema_rejects_bad_example_values(bad, match):
    with pytest.raises(Exception, match=match):
        render(bad)


def test_plain_ray_head_serves_jobs_api_only_when_job_submission_set():
    def head(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        objs = objects(values)
        deploy = next(
            o
            for o in _by_kind(objs, "Deployment")
            if o["metadata"]["name"].endswith("-ray-head")
        )
        svc = next(
            o
            for o in _by_kind(objs, "Service")
            if o["metadata"]["name"].endswith("-ray-head")
        )
        return deploy["spec"]["template"]["spec"]["containers"][0], svc

    container, svc = head({})
    assert "--include-dashboard=false" in container["command"]
    assert 8265 not in {p["port"] for p in svc["spec"]["ports"]}
    container, svc = head({"ray": {"head": {"jobSubmission": True}}})
    assert "--include-dashboard=true" in container["command"]
    assert "--dashboard-host=0.0.0.0" in container["command"]
    assert {"name": "dashboard", "containerPort": 8265} in container["ports"]
    assert 8265 in {p["port"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize(
    "values",
    [{}, {"kuberay": {"enabled": True}}, RAYJOB_EXAMPLE],
    ids=["default", "kuberay", "rayjob-example"],
)
def test_notes_never_tell_a_pod_outside_ray_to_ray_init(values):
    # A Ray driver needs a raylet on its own node (ray-project/ray#29893), so a
    # torchrun or PyTorchJob pod cannot ray.init() against the head's address.
    notes = render(values)["shardcache/templates/NOTES.txt"][0]["NOTES"]
    assert "ray.init" not in notes
    # Only the pods that ran `ray start` (b) are told to join their own node,
    # explicitly: the SDK never joins a cluster it finds by "auto" on its own.
    assert "RAY_ADDRESS" not in notes.replace("SHARDCACHE_RAY_ADDRESS", "")
    assert notes.count("SHARDCACHE_RAY_ADDRESS") == 1
    # Pods outside Ray are served by the node-local endpoint (issue 18), never Ray.
    assert "PyTorchJob" in notes and "node-local endpoint" in notes
    assert "RayJob" in notes


def test_notes_name_the_rendered_example_rayjob_when_examples_rayjob_enabled_set():
    notes = render(RAYJOB_EXAMPLE)["shardcache/templates/NOTES.txt"][0]["NOTES"]
    assert "rayjob/rel-shardcache-ray-train-example" in notes


def test_helm_test_pod_joins_ray_as_a_node_before_the_selftest_and_leaves_after():
    """A Ray 2.60 driver needs a raylet of its own host: the test pod starts
    one (zero CPUs, like a cache worker), runs the selftest through it, and
    stops it whatever the selftest returned."""
    (pod,) = [
        o
        for o in objects()
        if o["kind"] == "Pod"
        and o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["sh", "-c"]
    script = container["command"][2]
    start = script.index("ray start --address=rel-shardcache-ray-head:6379")
    selftest = script.index("&& shardcache selftest --ray-address auto")
    stop = script.index("rc=$?; ray stop --force")
    assert start < selftest < stop and script.rstrip().endswith("exit $rc")
    assert "--num-cpus=0" in script[start:selftest]
    assert "--dashboard-url http://rel-shardcache-dashboard:" in script
    assert "POD_IP" in _env_by_name(container)

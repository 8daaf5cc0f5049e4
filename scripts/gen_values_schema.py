"""Generate helm/shardcache/values.schema.json from values.yaml and its `# --` comments.

Run after editing values.yaml; a test fails when the two drift apart.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "helm" / "shardcache"
# Constraints beyond type/default: enums and lower bounds that make bad values fail clearly.
EXTRA: dict[str, dict[str, Any]] = {
    "cache.eviction": {"enum": ["lru", "static", "clairvoyant"]},
    "cache.disk.bytes": {"minimum": 1048576},
    "cache.cacheBytes": {"minimum": 1048576},
    "cache.fetchConcurrency": {"minimum": 1},
    "cache.fetchRetries": {"minimum": 0},
    "cache.buildWorkers": {"minimum": 0},
    "cache.preprocessWorkers": {"minimum": 1},
    "cache.sourceBurst": {"minimum": 1},
    "ray.objectStoreBytes": {"minimum": 78643200},
    "ray.spill.type": {"enum": ["emptyDir", "hostPath"]},
    "dashboard.replicas": {"minimum": 0},
    "dashboard.port": {"minimum": 1, "maximum": 65535},
    "dashboard.service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "shard.maxUnavailable": {"minimum": 1},
    "image.pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "cacheNamespace": {"pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"},
    "redis.external.url": {"pattern": "^$|^rediss?://"},
    "redis.persistence.size": {"pattern": "^[0-9]+(Ki|Mi|Gi|Ti)$"},
    "metrics.grafanaDashboard.namespace": {
        "pattern": "^$|^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
    },
    "examples.rayJob.url": {"pattern": "^$|^[a-z][a-z0-9+.-]*://"},
    "examples.rayJob.workers": {"minimum": 1},
    "endpoint.socketMode": {"minimum": 0, "maximum": 511},
    "endpoint.shmBytes": {"minimum": 16777216},
    "endpoint.hostPath": {"pattern": "^/"},
    "endpoint.flight.port": {"minimum": 1, "maximum": 65535},
    "endpoint.flight.streamPort": {"minimum": 0, "maximum": 65535},
    "examples.pyTorchJob.url": {"pattern": "^$|^[a-z][a-z0-9+.-]*://"},
    "examples.pyTorchJob.workers": {"minimum": 0},
    "examples.pyTorchJob.nprocPerNode": {"minimum": 1},
    "examples.pyTorchJob.epochs": {"minimum": 1},
    "examples.pyTorchJob.batchSize": {"minimum": 1},
    "examples.rayJob.epochs": {"minimum": 1},
    "examples.rayJob.batchSize": {"minimum": 1},
}
FREE_FORM = {
    "resources",
    "nodeSelector",
    "tolerations",
    "affinity",
    "annotations",
    "podSecurityContext",
    "securityContext",
    "imagePullSecrets",
    "requests",
    "limits",
}


def _comments(text: str) -> dict[str, str]:
    out, stack, pending = {}, [], ""
    for line in text.splitlines():
        m = re.match(r"^(\s*)# -- (.*)$", line)
        if m:
            pending = m.group(2)
            continue
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9_]*):", line)
        if m:
            depth = len(m.group(1)) // 2
            stack = stack[:depth] + [m.group(2)]
            out[".".join(stack)] = pending or out.get(".".join(stack), "")
            pending = ""
    return out


def _type(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }[type(value)]


def _schema(value: Any, path: str, notes: dict[str, str]) -> dict[str, Any]:
    name = path.rsplit(".", 1)[-1]
    node: dict[str, Any] = {
        "type": _type(value),
        "description": notes.get(path) or name,
        "default": value,
    }
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        node["minimum"] = 0
    if isinstance(value, dict) and name not in FREE_FORM:
        node["properties"] = {
            k: _schema(v, f"{path}.{k}" if path else k, notes) for k, v in value.items()
        }
        node["additionalProperties"] = False
    node.update(EXTRA.get(path, {}))
    return node


def build() -> dict[str, Any]:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    notes = _comments(text)
    schema = _schema(values, "", notes)
    schema.pop("default")
    schema["description"] = "shardcache chart values"
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "shardcache",
        **schema,
    }


if __name__ == "__main__":
    out = json.dumps(build(), indent=2) + "\n"
    if "--check" in sys.argv:
        sys.exit(0 if (CHART / "values.schema.json").read_text() == out else 1)
    (CHART / "values.schema.json").write_text(out)

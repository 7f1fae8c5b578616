"""Prints, as JSON, the fields of every model of the KServe SDK (PyPI `kserve`) and of `kubernetes`
reachable from the ServingRuntime and InferenceService models: {model: {JSON field: type}}.

tests/deploy/test_kserve.py runs this in its own process: importing `kserve` registers its
`inference.*` protobuf messages in protobuf's default pool, as `tritonclient.grpc` does, and one
process cannot hold both (the API tests import tritonclient).
"""

from __future__ import annotations

import json
import re
import sys

import kserve.models
import kubernetes.client.models

ROOTS = ("V1alpha1ServingRuntime", "V1beta1InferenceService", "V1beta1PredictorSpec", "V1PodSpec")


def model_class(name: str):
    return getattr(kserve.models, name, None) or getattr(kubernetes.client.models, name, None)


def fields() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        cls = model_class(name)
        if name in out or cls is None or not hasattr(cls, "openapi_types"):
            continue
        out[name] = {cls.attribute_map[attr]: kind for attr, kind in cls.openapi_types.items()}
        for kind in out[name].values():
            todo += re.findall(r"[A-Z]\w+", kind)
    return out


if __name__ == "__main__":
    json.dump(fields(), sys.stdout)

"""The ExpertGroup CRD the chart ships in ``crds/``: valid as an ``apiextensions.k8s.io/v1`` object against the
Kubernetes 1.30 and newest OpenAPI schemas (kubernetes-validate, strict), a structural schema, and the contract
of ``expertmesh.orchestrator.kube.group_objects``: its bounds are the schema's (sample specs at and past each
bound), every manifest and status the controller writes accepted, the phase enum, the printer columns. The RBAC
for it, gated by ``orchestrator.liveGroups``, is checked with the rest in test_helm_crd.py and
test_helm_chart.py. Not checkable here: the CEL rule (spec immutable) needs an API server to evaluate it.
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
from helmchart import CHART, K8S_VERSIONS, crd_names, printer_columns, structural_problems

from expertmesh.orchestrator.elastic.state import GroupPhase, GroupRecord
from expertmesh.orchestrator.kube.group_objects import (
    KIND,
    MAX_GPUS,
    MAX_ISLAND,
    MAX_NODE,
    PLURAL,
    ExpertGroup,
    GroupSpec,
    ObjectPhase,
    manifest,
    pending,
    refused,
    status_of,
)
from expertmesh.orchestrator.kube.resource import GROUP, VERSION

CRD_FILE = CHART / "crds" / f"{PLURAL}.{GROUP}.yaml"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_crd_validates_against_the_kubernetes_openapi_schema(crd, version):
    kubernetes_validate.validate(crd, version, strict=True)


def test_the_crd_names_scope_subresource_and_printer_columns(crd):
    assert crd_names(crd) == (GROUP, "Namespaced", KIND, PLURAL, VERSION, True, True, {"status": {}})
    assert crd["spec"]["names"]["shortNames"] == ["egroup"]
    assert printer_columns(crd) == [
        ("GPUS", ".spec.gpus"),
        ("ISLAND", ".spec.island"),
        ("PHASE", ".status.phase"),
        ("ENDPOINT", ".status.endpoint"),
        ("MOVES", ".status.moves"),
        ("AGE", ".metadata.creationTimestamp"),
    ]


def test_the_schema_is_structural(schema):
    assert structural_problems(schema) == []


def _unbounded(node: dict, where: str = "") -> list[str]:
    problems = [] if node.get("type") != "string" or "maxLength" in node or "enum" in node else [where]
    if node.get("type") == "integer" and not {"minimum"} <= node.keys():
        problems.append(where)
    for name, child in (node.get("properties") or {}).items():
        if where or name in ("spec", "status"):  # apiVersion, kind, metadata: the API server's
            problems += _unbounded(child, f"{where}.{name}")
    return problems


def test_every_field_is_bounded(schema):
    assert _unbounded(schema) == []


@pytest.mark.parametrize(
    "spec",
    [
        GroupSpec(),
        GroupSpec(MAX_GPUS, "a" * MAX_ISLAND, "n" * MAX_NODE),
        GroupSpec(2, "island-0"),
        GroupSpec(0, "", "n"),
    ],
)
def test_the_manifests_the_code_writes_are_accepted(schema, spec):
    jsonschema.validate(manifest("g5", spec), schema)
    jsonschema.validate(manifest("g5", spec, mirror=True), schema)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"gpus": -1}, "gpus"),
        ({"gpus": MAX_GPUS + 1}, "gpus"),
        ({"gpus": "2"}, "gpus"),
        ({"island": ""}, "island"),
        ({"island": "A"}, "island"),
        ({"island": "a" * (MAX_ISLAND + 1)}, "island"),
        ({"node": ""}, "node"),
        ({"node": "n" * (MAX_NODE + 1)}, "node"),
    ],
)
def test_specs_past_the_bounds_are_refused_naming_the_field_as_the_code_refuses_them(schema, spec, field):
    doc = manifest("g5", GroupSpec()) | {"spec": spec}
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(doc, schema)
    assert list(err.value.absolute_path) == ["spec", field]
    if spec[field] != "":  # "" is the code's "not given"; the schema wants the field left out instead
        with pytest.raises(ValueError, match=f"spec.{field}"):
            GroupSpec.from_dict(spec)


@pytest.mark.parametrize("phase", list(GroupPhase))
def test_every_status_the_controller_writes_fits_the_schema(schema, phase):
    obj = ExpertGroup.from_dict(manifest("g5", GroupSpec()) | {"status": {"phase": "Starting"}})
    record = GroupRecord("g5", phase, address="10.0.0.7:50102", reason="x" * 2000, moves_done=3, moves_planned=8)
    for status in (
        status_of(obj, record),
        pending(obj, "GroupChangeRefused", "group g4 is filling (1/8 moves); one group change at a time"),
        refused(obj, "InvalidName", "no group name"),
    ):
        jsonschema.validate(manifest("g5", GroupSpec()) | {"status": status.to_dict()}, schema)


def test_the_phase_enum_lists_every_phase_the_controller_writes(schema):
    assert schema["properties"]["status"]["properties"]["phase"]["enum"] == [p.value for p in ObjectPhase]

"""The ExpertQuarantine CRD the chart ships in ``crds/``: valid as an
``apiextensions.k8s.io/v1`` object against the Kubernetes 1.30 and newest OpenAPI
schemas (kubernetes-validate, strict), a structural schema, and the contract of
``expertmesh.orchestrator.kube.quarantine``: sample specs valid and invalid by its
``openAPIV3Schema``, every status the controller writes accepted, the printer columns.
The RBAC for it is checked with the rest in test_helm_crd.py. Not checkable here: the
CEL rule (spec immutable) needs an API server to evaluate it.
"""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
from helmchart import CHART, K8S_VERSIONS, crd_names, printer_columns, structural_problems

from expertmesh.orchestrator.health.monitor import ReplicaStatus
from expertmesh.orchestrator.health.state import HealthState, Initiator, ReplicaId, ReplicaRecord
from expertmesh.orchestrator.kube.quarantine import KIND, PLURAL, QuarantineSpec, State, manifest, refused, status_of
from expertmesh.orchestrator.kube.resource import API_VERSION, GROUP, VERSION

CRD_FILE = CHART / "crds" / f"{PLURAL}.{GROUP}.yaml"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_crd_validates_against_the_kubernetes_openapi_schema(crd, version):
    kubernetes_validate.validate(crd, version, strict=True)


def test_the_crd_names_scope_subresource_and_printer_columns(crd):
    assert crd_names(crd) == (GROUP, "Namespaced", KIND, PLURAL, VERSION, True, True, {"status": {}})
    assert printer_columns(crd) == [
        ("LAYER", ".spec.layer"),
        ("EXPERT", ".spec.expert"),
        ("GROUP", ".spec.group"),
        ("STATE", ".status.state"),
        ("AGE", ".metadata.creationTimestamp"),
    ]


def test_the_schema_is_structural(schema):
    assert structural_problems(schema) == []


@pytest.mark.parametrize("spec", [QuarantineSpec(0, 0), QuarantineSpec(3, 7, "g1", "outputs drifted")])
def test_the_manifests_the_code_writes_are_accepted(schema, spec):
    jsonschema.validate(manifest(spec, "q"), schema)
    jsonschema.validate(manifest(spec, "q", mirror=True), schema)


@pytest.mark.parametrize(
    "spec, where",
    [
        ({"layer": -1, "expert": 0}, ["spec", "layer"]),
        ({"layer": 0, "expert": "3"}, ["spec", "expert"]),
        ({"layer": 0, "expert": 0, "group": ""}, ["spec", "group"]),
        ({"layer": 0}, ["spec"]),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(schema, spec, where):
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "q"}, "spec": spec}, schema)
    assert list(err.value.absolute_path) == where


def _replica(group: str, state: HealthState, by: Initiator | None) -> ReplicaStatus:
    record = ReplicaRecord(
        ReplicaId(1, 2, group), state=state, reason="why", since=1_700_000_000.0, quarantined_by=by, repairs=1
    )
    return ReplicaStatus(record, listed=state is HealthState.HEALTHY)


@pytest.mark.parametrize("state", list(HealthState))
def test_every_status_the_controller_writes_fits_the_schema(schema, state):
    obj = manifest(QuarantineSpec(1, 2), "q")
    replicas = [
        _replica("g0", state, Initiator.MONITOR if state.out_of_service else None),
        _replica("g1", HealthState.HEALTHY, None),
    ]
    for status in (
        status_of(QuarantineSpec(1, 2), replicas, 3),
        status_of(QuarantineSpec(1, 2, "g9"), replicas, 3),
        refused("no such expert", 1),
    ):
        jsonschema.validate(copy.deepcopy(obj) | {"status": status.to_dict()}, schema)
    shown = status_of(QuarantineSpec(1, 2), replicas, 3)
    assert shown.state == State(state.value.capitalize()) and [r.group for r in shown.replicas] == ["g0", "g1"]


def test_the_state_enum_lists_every_state_the_controller_writes(schema):
    assert schema["properties"]["status"]["properties"]["state"]["enum"] == [s.value for s in State]

"""The ExpertMigration CRD the chart ships in ``crds/``: installed by Helm before the
templates (``helm template --include-crds``, ``helm show crds``), valid as an
``apiextensions.k8s.io/v1`` object against the Kubernetes 1.30 and newest OpenAPI
schemas (kubernetes-validate, strict), a structural schema, and the contract of
``expertmesh.orchestrator.kube``: sample objects valid and invalid by its
``openAPIV3Schema`` (jsonschema: the subset CRDs use is JSON Schema), every status the
controller writes accepted, the printer columns; and the orchestrator's RBAC for it.

Not checkable here: the CEL rules (``x-kubernetes-validations``: spec immutable, ``to``
required unless evict) need an API server to evaluate them; the controller refuses a
spec without ``to`` itself too (tests/orchestrator/test_kube_controller.py).
"""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helmchart import CHART, K8S_VERSIONS, crd_names, printer_columns, structural_problems, template_args

from expertmesh.orchestrator.kube.conditions import refused_status, status_of
from expertmesh.orchestrator.kube.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION
from expertmesh.orchestrator.migration.plan import PHASES
from expertmesh.orchestrator.migration.state import Failure, Migration, MigrationMode, Phase, PhaseChange

CRD_FILE = CHART / "crds" / "expertmigrations.expertmesh.io.yaml"


def sample(**spec) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "m"}, "spec": spec}


# -- shipped and installed -------------------------------------------------------------------------


def test_helm_installs_the_crd_from_crds_before_the_templates(helm):
    res = helm(*template_args(None, "--include-crds"))
    assert res.returncode == 0, res.stderr
    docs = res.docs
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert [d["metadata"]["name"] for d in crds] == [
        f"expertgroups.{GROUP}",
        f"{PLURAL}.{GROUP}",
        f"expertquarantines.{GROUP}",
    ]
    assert [docs.index(d) for d in crds] == [0, 1, 2], "CRDs come first"
    plain = helm(*template_args(None))
    assert plain.returncode == 0 and "CustomResourceDefinition" not in plain.stdout, (
        "not a template: never upgraded or deleted"
    )
    shown = helm("show", "crds", str(CHART))
    by_name = lambda docs: sorted(docs, key=lambda d: d["metadata"]["name"])  # noqa: E731
    files = [yaml.safe_load(f.read_text()) for f in CRD_FILE.parent.glob("*.yaml")]
    assert shown.returncode == 0 and by_name(yaml.safe_load_all(shown.stdout)) == by_name(files)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_crd_validates_against_the_kubernetes_openapi_schema(crd, version):
    kubernetes_validate.validate(crd, version, strict=True)


def test_the_crd_names_scope_subresource_and_printer_columns(crd):
    assert crd_names(crd) == (GROUP, "Namespaced", KIND, PLURAL, VERSION, True, True, {"status": {}})
    assert printer_columns(crd) == [
        ("LAYER", ".spec.layer"),
        ("EXPERT", ".spec.expert"),
        ("FROM", ".status.source"),
        ("TO", ".spec.to"),
        ("STATUS", ".status.phase"),
        ("AGE", ".metadata.creationTimestamp"),
    ]


def test_the_schema_is_structural(schema):
    assert structural_problems(schema) == []
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])


# -- the spec: what the API server accepts --------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"layer": 0, "expert": 0, "to": "g1"},
        {"layer": 3, "expert": 7, "from": "g0", "to": "g1", "mode": "move"},
        {"layer": 3, "expert": 7, "to": "g2", "mode": "replicate"},
        {"layer": 3, "expert": 7, "from": "g0", "mode": "evict"},
    ],
)
def test_valid_specs_are_accepted(schema, spec):
    jsonschema.validate(sample(**spec), schema)


@pytest.mark.parametrize(
    "spec, where",
    [
        ({"layer": -1, "expert": 0, "to": "g1"}, ["spec", "layer"]),
        ({"layer": 0, "expert": -1, "to": "g1"}, ["spec", "expert"]),
        ({"layer": 0, "expert": 0, "to": "g1", "mode": "teleport"}, ["spec", "mode"]),
        ({"layer": "0", "expert": 0, "to": "g1"}, ["spec", "layer"]),
        ({"layer": 0.5, "expert": 0, "to": "g1"}, ["spec", "layer"]),
        ({"layer": 0, "expert": 0, "to": ""}, ["spec", "to"]),
        ({"expert": 0, "to": "g1"}, ["spec"]),
        ({"layer": 0, "to": "g1"}, ["spec"]),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(schema, spec, where):
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(sample(**spec), schema)
    assert list(err.value.absolute_path) == where


def test_an_object_without_spec_is_refused(schema):
    with pytest.raises(jsonschema.ValidationError, match="'spec' is a required property"):
        jsonschema.validate({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "m"}}, schema)


# -- the status: what the controller writes fits ----------------------------------------------------


def _record(mode: MigrationMode, end: Phase, failure: Failure | None = None) -> Migration:
    order = PHASES[mode]
    phases = [p for p in order if p is not Phase.SUCCEEDED][:3] + ([end] if end.terminal else [])
    history = tuple(PhaseChange(p, 1_700_000_000.0 + i, 1 + i) for i, p in enumerate(phases))
    return Migration(
        id="0123456789ab",
        layer=1,
        expert=1,
        mode=mode,
        source="g0",
        target=None if mode is MigrationMode.EVICT else "g2",
        phase=history[-1].phase,
        table_version=history[-1].table_version,
        replicas_before=("g0",),
        shares_before=(),
        started_at=history[0].at,
        completed_at=history[-1].at if end.terminal else None,
        failure=failure,
        reason="over its memory budget" if failure else "",
        history=history,
    )


@pytest.mark.parametrize("mode", list(MigrationMode))
@pytest.mark.parametrize(
    "end, failure",
    [(Phase.PENDING, None), (Phase.FAILED, Failure.OVER_BUDGET), (Phase.ROLLED_BACK, Failure.DRAIN_TIMEOUT)],
)
def test_every_status_the_controller_writes_fits_the_schema(schema, mode, end, failure):
    obj = sample(layer=1, expert=1, to="g2")
    for status in (
        status_of(_record(mode, end, failure), 2),
        refused_status("Refused", "unknown group 'g9'", 1_700_000_000.0, 1),
    ):
        written = copy.deepcopy(obj) | {"status": status.to_dict()}
        jsonschema.validate(written, schema)
    succeeded = _record(mode, Phase.PENDING)
    done = succeeded.entering(Phase.SUCCEEDED, 1_700_000_100.0)
    jsonschema.validate(copy.deepcopy(obj) | {"status": status_of(done, 1).to_dict()}, schema)


def test_the_status_phase_enum_lists_every_executor_phase(schema):
    from expertmesh.orchestrator.kube.resource import camel

    assert schema["properties"]["status"]["properties"]["phase"]["enum"] == [camel(p.value) for p in Phase]


# -- RBAC: the orchestrator may do what the controller and topology discovery call, nothing more -----


def test_orchestrator_rbac_covers_exactly_the_calls_of_the_kube_package(render):
    docs = render("defaults")
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (cluster,) = [d for d in docs if d["kind"] == "ClusterRole"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"] + cluster["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if resource
        in (
            *(PLURAL, f"{PLURAL}/status", "expertquarantines", "expertquarantines/status"),
            *("expertgroups", "expertgroups/status", "events", "nodes"),
        )
    }
    assert granted == {
        # the watch loop (list + watch), re-reads on conflict (get), the drift controller (create)
        *((GROUP, PLURAL, verb) for verb in ("get", "list", "watch", "create")),
        # status writes are merge patches of the status subresource
        (GROUP, f"{PLURAL}/status", "patch"),
        # the ExpertQuarantine controller: lists every pass, re-reads on conflict, creates and deletes mirrors
        *((GROUP, "expertquarantines", verb) for verb in ("get", "list", "create", "delete")),
        (GROUP, "expertquarantines/status", "patch"),
        # the ExpertGroup controller (orchestrator.liveGroups, on by default): the same verbs, for its mirrors
        *((GROUP, "expertgroups", verb) for verb in ("get", "list", "create", "delete")),
        (GROUP, "expertgroups/status", "patch"),
        # one Event per phase change, never updated
        ("", "events", "create"),
        # node-label topology discovery
        *(("", "nodes", verb) for verb in ("get", "list", "watch")),
    }

"""How ``deploy`` and ``undeploy`` wait on the groups application: the polling loop against a
scripted sequence of the statuses Serve's controller reports. Scripted because a replica that fails
to load reaches DEPLOY_FAILED only after Serve's constructor retries (three worker starts, ~20 s on
these cores); the real status call is asserted on a running and a closed platform in test_fidelity."""

from types import SimpleNamespace

import pytest
from ray.serve.schema import ApplicationStatus

from expertmesh.expert_group import deployment


def _script(monkeypatch, *statuses):
    """``app_status()`` answers these in turn, then the last one for ever; returns how many were asked."""
    asked = []

    def app_status():
        asked.append(1)
        status, message = statuses[min(len(asked), len(statuses)) - 1]
        return SimpleNamespace(app_status=SimpleNamespace(status=status, message=message), deployment_statuses=[])

    monkeypatch.setattr(deployment, "app_status", app_status)
    monkeypatch.setattr(deployment, "STATUS_POLL_S", 0.001)
    return asked


def _running(app):
    return app.status == ApplicationStatus.RUNNING


def test_waits_through_deploying_until_running(monkeypatch):
    asked = _script(
        monkeypatch,
        (ApplicationStatus.NOT_STARTED, ""),
        (ApplicationStatus.DEPLOYING, ""),
        (ApplicationStatus.RUNNING, ""),
    )
    deployment._wait_for_app(_running, "start", 5.0)
    assert len(asked) == 3


def test_a_failed_deployment_raises_with_serves_message(monkeypatch):
    _script(
        monkeypatch,
        (ApplicationStatus.DEPLOYING, ""),
        (ApplicationStatus.DEPLOY_FAILED, "replica raised OverBudget: 4 MiB over"),
    )
    with pytest.raises(
        RuntimeError, match="Deploying application expertmesh-groups failed: replica raised OverBudget: 4 MiB over"
    ):
        deployment._wait_for_app(_running, "start", 5.0)


def test_gives_up_at_the_timeout_naming_the_last_status(monkeypatch):
    _script(monkeypatch, (ApplicationStatus.DELETING, ""))
    with pytest.raises(TimeoutError, match=r"did not stop within 0s \(Serve status: DELETING\)"):
        deployment._wait_for_app(lambda app: app.status == ApplicationStatus.NOT_STARTED, "stop", 0.05)


def _spec(name):
    return deployment.GroupSpec(name=name, model_path="/m", pairs=())


def test_a_group_added_that_fails_is_taken_out_again_and_the_others_keep_their_versions(monkeypatch):
    """``GroupsApp.add``: Serve's DEPLOY_FAILED raises with its message, after the application is handed back
    to the groups that ran, under their own versions (so their replicas are left alone)."""
    runs = []
    monkeypatch.setattr(deployment, "_run", lambda specs, versions: runs.append(([s.name for s in specs], versions)))
    _script(monkeypatch, (ApplicationStatus.DEPLOYING, ""), (ApplicationStatus.DEPLOY_FAILED, "g2 raised"))
    app = deployment.GroupsApp()
    app.specs, app._versions = {"g0": _spec("g0"), "g1": _spec("g1")}, {"g0": "v0", "g1": "v1"}
    with pytest.raises(RuntimeError, match="failed: g2 raised"):
        app.add(_spec("g2"), timeout_s=5.0)
    (added, versions), (back, back_versions) = runs
    assert added == ["g0", "g1", "g2"] and versions["g0"] == "v0" and versions["g1"] == "v1"
    assert back == ["g0", "g1"] and back_versions == {"g0": "v0", "g1": "v1"}
    assert sorted(app.specs) == ["g0", "g1"]


def test_a_group_removed_waits_until_serve_no_longer_lists_its_deployment(monkeypatch):
    runs = []
    monkeypatch.setattr(deployment, "_run", lambda specs, versions: runs.append(versions))
    listed = [["directory", "group-g0", "group-g1"]] * 3 + [["directory", "group-g1"]]
    asked = []

    def app_status():
        asked.append(1)
        names = listed[min(len(asked), len(listed)) - 1]
        return SimpleNamespace(
            app_status=SimpleNamespace(status=ApplicationStatus.RUNNING, message=""),
            deployment_statuses=[SimpleNamespace(name=n, status="HEALTHY") for n in names],
        )

    monkeypatch.setattr(deployment, "app_status", app_status)
    monkeypatch.setattr(deployment, "STATUS_POLL_S", 0.001)
    app = deployment.GroupsApp()
    app.specs, app._versions = {"g0": _spec("g0"), "g1": _spec("g1")}, {"g0": "v0", "g1": "v1"}
    app.remove("g0", timeout_s=5.0)
    assert runs == [{"g1": "v1"}] and len(asked) == 4 and list(app.specs) == ["g1"]

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

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


class _Replica:
    """What the directory calls of a group's handle: ``address.remote()``, an awaitable answer. ``None``:
    a replica that never answers, as one waiting for a Ray node that is away (Serve queues the call)."""

    def __init__(self, address: str | None):
        self.address = SimpleNamespace(remote=lambda: self._answer(address))

    async def _answer(self, address):
        import asyncio

        if address is None:
            await asyncio.Event().wait()
        return address


def test_the_directory_lists_the_groups_that_answer_within_the_wait_and_leaves_out_one_that_does_not():
    """A lookup while a node is away: the groups there are left out after ``wait_s`` (the router keeps their
    last address) instead of holding every router's lookup until Serve's 120 s timeout."""
    import asyncio

    directory = deployment.GroupDirectory(**{"gpu-0": _Replica(None), "gpu-1": _Replica("10.0.0.2:9000")})
    # (the outer bound only turns a lookup that waits for ever into a failure instead of a hung test)
    assert asyncio.run(asyncio.wait_for(directory.addresses(wait_s=0.2), 120)) == {"gpu-1": "10.0.0.2:9000"}
    everyone = deployment.GroupDirectory(a=_Replica("1.1.1.1:1"), b=_Replica("2.2.2.2:2"))
    assert asyncio.run(everyone.addresses()) == {"a": "1.1.1.1:1", "b": "2.2.2.2:2"}

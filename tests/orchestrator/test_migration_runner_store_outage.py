"""A migration whose orchestrator loses the store mid-way (its host cut off, Redis unreachable)
resumes from its stored record once the store answers, rather than stopping half done until
the orchestrator restarts (found by ``bench chaos --hosts``: orchestrator-cut-off-mid-migration)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from expertmesh.orchestrator import admin


class _Executor:
    """Stands in for MigrationExecutor.run: the store unreachable for the first ``outages`` runs."""

    def __init__(self, outages: int):
        self.outages = outages
        self.runs: list[str] = []

    def run(self, migration_id: str):
        self.runs.append(migration_id)
        if len(self.runs) <= self.outages:
            raise ConnectionError("the Redis state store is unreachable: Timeout reading from socket")
        return SimpleNamespace(describe=lambda: f"migration {migration_id}", phase="succeeded", reason="")

    def close(self) -> None:
        pass


def test_a_migration_resumes_from_its_record_once_the_store_answers_again(monkeypatch):
    monkeypatch.setattr(admin, "STORE_RETRY_S", 0.01)
    executor = _Executor(outages=3)
    runner = admin.MigrationRunner(None, executor)
    runner._start("m1")
    assert runner.wait_idle(10)
    assert executor.runs == ["m1"] * 4
    runner.close()


def test_closing_the_runner_stops_a_migration_waiting_for_the_store():
    executor = _Executor(outages=10**9)
    runner = admin.MigrationRunner(None, executor)
    runner._start("m1")
    time.sleep(0.1)
    closed = threading.Thread(target=runner.close)
    closed.start()
    closed.join(timeout=5)
    assert not closed.is_alive()  # the record stays resumable for the next orchestrator
    assert len(executor.runs) < 10

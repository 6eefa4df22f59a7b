"""Expert groups as child processes of this one (``expertmesh group serve``), for callers
that want them without Ray: the dispatch benchmark (``--groups-as process``) and tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from expertmesh.contracts.errors import GroupUnavailable
from expertmesh.expert_group.runtime import BANNER


@dataclass
class GroupProcess:
    name: str
    address: str
    proc: subprocess.Popen
    #: its stderr so far (logs), collected by a thread so the pipe never fills
    stderr: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, then wait (SIGKILL after ``timeout_s``); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _spawn(name: str, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "expertmesh.cli.main", "group", "serve", "--group", name, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), name=f"expertmesh-{name}-stderr", daemon=True).start()
    return proc, stderr


def start_groups(names: list[str], args: list[str], env: dict[str, str] | None = None) -> dict[str, GroupProcess]:
    """``expertmesh group serve --group NAME ARGS`` for every name, all starting at once; returns
    once each has printed its banner. One that exits first stops them all and raises with its stderr."""
    env = {**os.environ, **(env or {})}
    spawned = {name: _spawn(name, args, env) for name in names}
    groups: dict[str, GroupProcess] = {}
    try:
        for name, (proc, stderr) in spawned.items():
            banner = proc.stdout.readline()
            match = BANNER.search(banner)
            if match is None:
                proc.wait()
                raise GroupUnavailable(f"expert group {name} did not start: {''.join(stderr)[-2000:] or banner}")
            groups[name] = GroupProcess(name, match.group(2), proc, stderr)
    except BaseException:
        for proc, _ in spawned.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise
    return groups

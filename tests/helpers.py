"""Small helpers shared by the test modules that run expertmesh processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A port free right now; only for servers that cannot take port 0 (Ray's head, fixed port bases)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive ports free right now (for a fixed port base)."""
    for _ in range(50):
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise OSError(f"no {n} consecutive free ports found")


def serving_address(banner: str) -> str:
    """host:port from `expertmesh up`'s banner ("expertmesh is serving M on HOST:PORT — try: ...")."""
    return re.search(r" on (\S+:\d+) ", banner).group(1)


class Up:
    """`expertmesh up ARGS` as a process: waits for its banner, collects its stderr."""

    def __init__(self, *args, env=None):
        self.proc = subprocess.Popen(
            # Port 0, read back from the banner: a port picked in advance can be taken by one of
            # the Ray workers the command starts before it binds.
            [sys.executable, "-m", "expertmesh.cli", "up", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.banner = self.proc.stdout.readline()  # blocks until it serves (or exits)
        assert "expertmesh is serving" in self.banner, "".join(self.stderr)[-3000:]
        self.target = serving_address(self.banner)

    def stop(self, timeout=90) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def wait_for_stderr(self, pattern: str, timeout: float = 30) -> re.Match:
        """The first stderr line matching ``pattern`` (the reader thread may lag the banner)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.stderr):
                match = re.search(pattern, line)
                if match:
                    return match
            time.sleep(0.05)
        raise AssertionError(f"no stderr line matched {pattern!r}: {''.join(self.stderr)[-2000:]}")

"""Small helpers shared by the test modules that run expertmesh processes."""

from __future__ import annotations

import re
import socket


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

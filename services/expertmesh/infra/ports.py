"""Loopback ports free right now, for the servers that cannot take port 0: a Ray head, the fixed port base
of expert groups deployed together. (Free now is not reserved: another process may take one before it binds.)"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free right now; OSError when 50 tries find none."""
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
    raise OSError(f"found no {n} consecutive free loopback ports")

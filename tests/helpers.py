"""Small helpers shared by the test modules that run expertmesh processes."""

from __future__ import annotations

import re
import socket


def free_port() -> int:
    """A port free right now; only for servers that cannot take port 0 (Ray's head, fixed port bases)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_address(banner: str) -> str:
    """host:port from `expertmesh up`'s banner ("expertmesh is serving M on HOST:PORT — try: ...")."""
    return re.search(r" on (\S+:\d+) ", banner).group(1)

"""Memory measured where a process computes, as the field report's drift scans it: the device's memory in use and
its size, not the weights a group counts against its budget.

- CUDA: ``torch.cuda.mem_get_info`` (the whole device's free and total bytes: other processes and the caching
  allocator's reserve included, which is what runs out), used = total - free.
- CPU: this process's resident memory (``/proc/self/status`` VmRSS) against what it may use: its container's
  cgroup v2 limit (``memory.max``) when it has one, else the host's physical memory.

Both are best-effort: a query that fails (no /proc, a CUDA error) reads (0, 0), "not measured".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["MemoryReading", "measure"]

CGROUP_LIMIT = "/sys/fs/cgroup/memory.max"


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int
    total_bytes: int

    @property
    def fraction(self) -> float | None:
        """used / total; None when not measured."""
        return self.used_bytes / self.total_bytes if self.total_bytes > 0 else None


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    return 0


def _host_limit_bytes() -> int:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open(CGROUP_LIMIT) as f:
            limit = f.read().strip()
    except OSError:
        return physical
    return physical if limit == "max" else min(physical, int(limit))


def measure(device: torch.device) -> MemoryReading:
    """The memory in use where ``device`` is and its size (see the module); (0, 0) when it cannot be read."""
    try:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return MemoryReading(total - free, total)
        return MemoryReading(_rss_bytes(), _host_limit_bytes())
    except (OSError, RuntimeError, ValueError):
        return MemoryReading(0, 0)

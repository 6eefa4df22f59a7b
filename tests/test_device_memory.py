"""Memory measured where a group computes (``infra.device_memory``): this process's resident bytes against the
host's (or its container's) memory on CPU, the device's used and total bytes on CUDA. The CUDA query is faked
(no GPU here): only ``torch.cuda.mem_get_info``, as it answers (free, total)."""

from __future__ import annotations

import torch

from expertmesh.infra import device_memory


def test_the_cpu_reading_is_this_process_against_the_host():
    reading = device_memory.measure(torch.device("cpu"))
    assert 0 < reading.used_bytes < reading.total_bytes
    assert 0 < reading.fraction < 1
    grown = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB touched: the resident bytes grow by about that
    assert device_memory.measure(torch.device("cpu")).used_bytes >= reading.used_bytes + 48 * 1024 * 1024
    del grown


def test_a_cuda_reading_is_the_devices_used_and_total(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * 2**30, 80 * 2**30))
    reading = device_memory.measure(torch.device("cuda", 0))
    assert (reading.used_bytes, reading.total_bytes) == (50 * 2**30, 80 * 2**30) and reading.fraction == 0.625


def test_a_query_that_fails_reads_not_measured(monkeypatch):
    def broken(device=None):
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    reading = device_memory.measure(torch.device("cuda", 0))
    assert (reading.used_bytes, reading.total_bytes, reading.fraction) == (0, 0, None)

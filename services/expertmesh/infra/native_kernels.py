"""Building the project's CPU kernels (C++ sources beside the modules that call them) on the host they run on.

torch's C++ extension loader (``torch.utils.cpp_extension.load_inline``: g++ and ninja, the ``ninja`` package a
dependency) compiles a source for the host's vector unit (``-march=native``) into torch's extensions folder
(``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``), so a machine compiles each kernel once (~25 s)
and every later process loads it in well under a second. The build's name carries a digest of the host CPU's
feature flags: a build for one host is never loaded on another (a shared extensions folder, an image moved
between nodes). ``load_cpu_kernel`` never raises: each kernel has a slower path beside it, and a failed build is
logged once by the caller's logger, saying which path serves instead.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["load_cpu_kernel"]


def load_cpu_kernel(
    name: str, source: Path, what: str, instead: str, registered: Callable[[], object], log: logging.Logger
) -> bool:
    """Whether ``source`` is built (once per machine) and its ops registered (``registered()`` looks one up and
    raises where it is not). Logs the build's start and end as ``what``, or once why it failed and ``instead``."""
    started = time.monotonic()
    log.info("%s: loading (compiled once per machine, ~25 s the first time)", what)
    try:
        _build(name, source)
        registered()
    except Exception as err:  # a missing compiler or ninja, a failed build: the slower path serves
        log.warning("%s unavailable (%s); %s", what, err, instead)
        return False
    log.info("%s: ready in %.1f s", what, time.monotonic() - started)
    return True


def _build(name: str, source: Path) -> None:
    """Compiles (once per machine) and loads ``source``, whose ops register themselves with torch
    (``TORCH_LIBRARY``). Raises what the build raises (no compiler, no ninja, a compile error)."""
    from torch.utils.cpp_extension import load_inline

    load_inline(
        f"{name}_{_host_vector_unit()}",
        cpp_sources=[source.read_text()],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )


def _host_vector_unit() -> str:
    """A short digest of the host CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:10]

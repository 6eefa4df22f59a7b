"""How many torch intra-op threads a process computing beside expert groups on the same host should use.

Each expert group computes with ``max(1, int(num_cpus))`` threads of its own. The router computes with every
core of the host: it and its local groups take turns each MoE layer (the router waits while the groups compute,
the groups wait while it computes), and its idle OpenMP threads sleep rather than spin (``OMP_WAIT_POLICY``
PASSIVE, set by the CLI; with the groups in its own process they spin a short while first: ``infra.openmp_wait``),
so its threads do not take cores from them. Measured (2 cores, 2 local groups, the
214 M Mixtral, 2026-12-05, clients in their own process, each setting twice, interleaved): 2 router threads
against 1 gave 71.8 / 78.9 against 69.4 / 72.0 tok/s at 8 clients of 480-token prompts and 96-token answers,
134.3 / 140.0 against 125.2 / 130.2 at 32, 104.5 against 101.6 at 8 clients of 64 / 256 (decode-heavy), and
24.4 / 25.1 against 25.5 / 27.0 at one client (a one-token step gains nothing from a second thread). Before
the OpenMP threads slept and the row sums stopped waking them (``infra.row_sums``), 1 thread was faster (one
client: 51 against 67 ms a token).

A small step is another matter (``one_thread_while``): a decode step of a few sequences runs hundreds of ops too
small to share out, each parallel region still costs a wake-up of the idle thread (~40 us where it slept through
the experts' phase: a [32, 8] softmax 41.6 us against 3.4 awake), and that thread, woken, takes the core a local
group's lane computes on. So the serving engine runs a step of at most ``serial_step_tokens`` tokens on one thread
(``serving.model_runner``). Measured with ``up --groups-as in-process`` on the 214M Mixtral (2-core AVX-512 host,
a decode step's median over ~250 steps, the router's threads at one for every step against two): 8 sequences
29.7 against 33.1-33.7 ms, 16: 36.3 against 37.6, 1: 14.6 against 14.3-15.0, 32: 43.8 against 44.0-45.8, but 64:
73.3 against 63.2 and a 480-token prompt's chunk 6% slower; hence 16 then. What lost at 64 were the step's few
large products (the attention projections, the LM head, the decode attention) on one thread: they now widen
back to the router's threads for their own call (``all_threads_for``: a product of at least ``WIDE_WORK``
outputs), and the step's other ops, a [64, 512] elementwise op just at torch's parallel grain among them, stay on
one. Measured in one server, the two settings alternating every 5 steps (~60 steps each, the grouped kernel's
products): 64 by default with the products widened against 16 without, a decode step of 8 / 16 / 32 / 64
sequences 25.1 / 30.4 / 37.5 / 51.6 ms against 26.1 / 31.4 / 40.0 / 54.1, one sequence 14.5 against 14.9.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


def group_threads(num_cpus: float) -> int:
    """The intra-op threads an expert group reserving ``num_cpus`` CPUs computes with (``expert_group.runtime``)."""
    return max(1, int(num_cpus))


def router_threads(setting: int, cpus: int) -> int:
    """``setting`` if set (> 0); else (auto) all the host's ``cpus``, whether or not expert groups run beside it."""
    if setting > 0:
        return setting
    return max(1, cpus)


def router_threads_here(setting: int) -> int:
    """``router_threads`` on this host: ``setting`` if set, else every CPU this process may run on (its
    affinity). What ``up`` sets the router's torch threads to and what the data plane's lanes share out."""
    return router_threads(setting, len(os.sched_getaffinity(0)))


@contextmanager
def at_threads(threads: int) -> Iterator[None]:
    """Within, the calling thread's torch ops run on ``threads`` intra-op threads; its own count is restored
    after (nothing is set where it is already ``threads``)."""
    now = torch.get_num_threads()
    if threads == now:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(now)


@contextmanager
def one_thread_while(serial: bool) -> Iterator[None]:
    """Within, the calling thread's torch ops run on one intra-op thread when ``serial`` (else as they were); its
    count is restored after."""
    with at_threads(1) if serial else nullcontext():
        yield


#: a product of at least this many outputs (rows x columns) computes on all of the router's threads in a step
#: narrowed to one (``all_threads_for``): [16, 512] and up, where a second thread's share outweighs its wake-up
WIDE_WORK = 8192


@contextmanager
def all_threads_for(work: int, threads: int) -> Iterator[None]:
    """Within, the calling thread's torch ops run on ``threads`` intra-op threads when ``work`` (the outputs of the
    one product inside) is at least ``WIDE_WORK`` and the thread runs on fewer now (a step narrowed by
    ``one_thread_while``); else as they are. ``threads``: the router's (0: leave them)."""
    with at_threads(threads) if work >= WIDE_WORK and torch.get_num_threads() < threads else nullcontext():
        yield

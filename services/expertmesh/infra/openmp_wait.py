"""How an ``expertmesh`` process's idle OpenMP threads wait between parallel regions: chosen before torch loads its
OpenMP runtime (GNU libgomp, which reads the environment once), from the command line, unless the environment
says already (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set: left as they are).

Why two ways:
- expert groups in other processes on the same cores (``up --groups-as ray`` or ``process``, ``group serve``,
  anything else): idle threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``). A router spends most of a step waiting
  for its groups; threads spinning meanwhile take the cores the groups compute on (measured on this project's
  2-core host: 5x slower dispatch).
- expert groups in the router's own process (``--groups-as in-process``: ``up``, ``bench serve``): idle threads spin
  a short while before they sleep (``GOMP_SPINCOUNT``). Nobody else waits for those cores: the groups' calls run on
  the router's own threads, and a thread asleep costs each parallel region a wake-up (a futex, tens of
  microseconds) where a step runs hundreds of small ones. Measured with ``up --groups-as in-process`` on the
  214M Mixtral (one server per setting, alternating; a decode step's median over 180-190 steps): 64 clients 113.7
  / 118.4 ms against 122.2 / 131.7 asleep; 8 clients 57.7 / 54.8 / 59.5 against 66.3 / 58.7 / 57.2; one client
  28.1 / 28.1 against 26.6 / 28.5 (no change).

``ADDED`` keeps what this process added, so that a process it starts with settings of its own (the vLLM baseline
of ``bench serve``) can be given the environment without them.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

__all__ = ["ADDED", "IN_PROCESS_SPINCOUNT", "apply", "settings_for"]

#: spins of an idle OpenMP thread before it sleeps, with the groups in the process (libgomp's own default when
#: nothing is set is 300000; a pause instruction a spin)
IN_PROCESS_SPINCOUNT = "30000"

#: the settings ``apply`` added to this process's environment
ADDED: dict[str, str] = {}


def settings_for(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP settings to add for command line ``argv`` (its arguments, without the program) in environment
    ``environ``: none where the environment sets either already.

    Example: ["up", "--groups-as", "in-process"], {} -> {"GOMP_SPINCOUNT": "30000"}; ["up"], {} ->
    {"OMP_WAIT_POLICY": "PASSIVE"}."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    if _groups_in_process(argv):
        return {"GOMP_SPINCOUNT": IN_PROCESS_SPINCOUNT}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def apply(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """``settings_for``'s settings added to ``environ`` (and to ``ADDED``); before torch loads."""
    added = settings_for(argv, environ)
    environ.update(added)
    ADDED.update(added)


def _groups_in_process(argv: Sequence[str]) -> bool:
    """Whether the command line computes its expert groups in its own process (``--groups-as in-process``, either
    spelling); an abbreviated option reads as not (the sleeping default)."""
    return "--groups-as=in-process" in argv or any(
        arg == "--groups-as" and value == "in-process" for arg, value in zip(argv, argv[1:])
    )

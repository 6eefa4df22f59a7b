"""Expert placement: which GPUs hold replicas of each (layer, expert), and what share
of that expert's tokens each replica takes.

Split like vLLM's EPLB into state (``stats``: observed load; the GPU plan itself is a file format,
``expertmesh.contracts.gpu_plan``), algorithm (``planner``, its island placement ``islands``, the
``incremental`` planner from a previous placement, ``eplb`` baseline, ``quality``, ``memory``; pure, no I/O)
and the step to expert groups (``to_groups``). The benchmark is ``expertmesh.bench.placement``, the
commands ``expertmesh.cli.orchestrator``.
"""

"""Expert placement: which GPUs hold replicas of each (layer, expert), and what share
of that expert's tokens each replica takes.

Split like vLLM's EPLB into state (``stats``: observed load; ``plan``: the
placement), algorithm (``planner``, ``eplb`` baseline, ``metrics``; pure, no I/O)
and commands (``bench``; the CLI lives in ``expertmesh.cli.orchestrator``).
"""

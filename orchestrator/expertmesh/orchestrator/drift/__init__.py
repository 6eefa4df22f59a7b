"""Dynamic expert drift: move experts off groups that stay too full or too busy,
and re-plan layers whose load stays unbalanced, through live migrations.

Split like vLLM's EPLB and ``orchestrator.migration``: ``state`` (what a scan
observes, what the controller remembers between scans, what it decides: plain
data), ``policy`` and ``rebalance`` (the algorithm: pure functions, no I/O),
``observe`` (the I/O that builds an observation from the state store and the
groups' Describe), ``controller`` (one scan = observe, decide, submit the moves
through the ``MigrationRunner`` unless it is a dry run, record every decision;
and the loop that scans every ``scan_interval_s``), ``config`` (the typed
settings, ``EXPERTMESH_DRIFT_*``), ``api`` (a scan as the admin API's
``ScanDriftResponse``) and ``cli`` (``expertmesh drift --once``).

Glossary
--------
scan
    One look at every expert group and the routers' load windows, and the
    decisions taken on it. The loop scans every ``scan_interval_s``; ``expertmesh
    drift --once`` asks the orchestrator for one now.
memory utilisation
    A group's expert weights over its memory budget (``weight_bytes /
    budget_bytes`` from Describe). A group without a budget has none: it never
    counts as full, and as a target its room is unbounded (it ranks above every
    budgeted group). On a GPU this is still the weights against the configured
    budget, not NVML's device memory, which the orchestrator cannot read from
    where it runs.
busy fraction
    Of the wall-clock seconds between two scans, the share during which the group
    computed at least one Dispatch (Describe's cumulative ``busy_seconds``,
    differenced). Unknown on a group's first scan and after it restarted.
level
    max(memory utilisation, busy fraction), the unknowns counting as 0. A group
    is *above the high watermark* when its level is above ``high_watermark``,
    *below the low watermark* when it is below ``low_watermark``.
replica load
    Tokens that chose a (layer, expert) over the routers' load windows (every
    router summed) times the share of them the group takes (routing table).
window tokens
    Tokens in the load windows, the busiest MoE layer's (sum of its experts'
    loads / top-k). Below ``min_window_tokens`` nothing moves: which expert is
    least used cannot be told from a handful of tokens.
balancedness
    Of one MoE layer over the groups: mean / max of the groups' token loads
    (``orchestrator.placement.metrics``), 1.0 when even or idle.
cooldown
    An expert that any migration (drift's or an operator's, whatever its end)
    started to move within ``cooldown_s`` is not moved again. Taken from the
    migration records in the state store rather than remembered by the
    controller, so a restarted orchestrator still honours it.

The two triggers (see ``policy``)
---------------------------------
high_watermark
    A group above the high watermark for ``consecutive_scans`` scans in a row
    moves its ``experts_per_move`` least-used experts (lowest replica load
    first, skipping those in cooldown or without a target) each to the group
    below the low watermark with the most room that does not already serve it
    and stays at or under the high watermark with it.
rebalance (off unless ``rebalance``)
    A layer below ``rebalance_below`` balancedness for ``consecutive_scans`` scans
    in a row is re-planned with the placement planner given the current placement
    (``expertmesh plan --current``: groups as GPUs, one replica per expert,
    ``rebalance_min_gain``); the experts it puts elsewhere move, heaviest first,
    at most ``max_concurrent_moves`` (the runner's) in flight at once.

Every decision, a move or a hold with its reason, is recorded: a log line (one
JSON object with ``--log-format json``), an event on the scan's span, the
counter ``expertmesh.drift.decisions`` (``result``, ``reason``, ``hold``) and the
``on_decision`` hook (where cluster mode posts a Kubernetes Event). The moves
themselves carry ``initiator="drift:<trigger>"`` on their migration records.
"""

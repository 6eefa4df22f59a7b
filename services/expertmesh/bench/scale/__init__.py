"""The control plane simulated at scale (``expertmesh bench scale``): the real placement planner,
drift policy, health policy and migration executor, driven by simulated expert groups and routers
over an in-memory store that counts operations, on a simulated clock.

Split: ``model`` (shapes, cost models, the drifting Zipf load: pure functions), ``simulated``
(groups, routers and the counting store: the simulated I/O), ``run`` (one case: a simulated day).

Glossary
--------
simulated time
    The clock the simulation advances (``Clock``): router polls, load times, drain waits and the
    hours of the day are in it. Figures named ``*_sim_s`` are simulated seconds.
wall time
    Seconds this process spent, measured with ``time.perf_counter`` around the real algorithms
    only (planner, drift decisions, health judging and output summaries). Figures named ``*_wall_s``.
serve delay
    Simulated seconds from a routing-table publish until a router steps with it: the wait for its
    next poll, the table fetch, the step boundary.
store op
    One call on the state store's backend (GET, compare-and-set, HSET, HDEL, HGETALL), counted by
    kind and by who made it (routers, orchestrator).
balancedness
    Mean over MoE layers of (mean / max of the groups' token loads), 1.0 when even
    (``placement.metrics``).
"""

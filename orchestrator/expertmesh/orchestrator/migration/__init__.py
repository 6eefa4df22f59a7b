"""Live expert migration, make before break: move, replicate or evict one
(layer, expert) replica while routers keep serving.

Split like vLLM's EPLB and ``orchestrator.placement``: ``state`` (the
migration record and its lifecycle, persisted in the state store), ``plan``
(the pure protocol: phase order, routing-table edits, drain and canary rules;
no I/O), ``group_calls`` (gRPC calls to expert groups, typed) and ``executor`` (the
I/O that drives a record through its phases).

Glossary
--------
pair
    ``(layer, expert)``: one logical expert of one MoE layer.
replica
    A group that holds a pair's weights *and* is listed for it in the routing table.
source / target
    The replica a move takes the expert from / the group it puts it on. For a
    replicate the source is only the canary's reference; for an evict it is the
    replica removed, and there is no target.
make / break
    Publishing a table that adds the target / that removes the source.
acknowledged
    Every *live* router (heartbeat younger than ``router_liveness_s``) reports a
    routing-table version at least the one in question. Routers only ever switch
    forward to the newest table, so a router that has acknowledged version ``n``
    never again uses a table older than ``n``.
drained
    Acknowledged, and the replica being removed has no Dispatch call in flight
    for the pair that a router sent with an older table version (version 0 marks
    calls that name no table, such as the canary, and is ignored).

The protocol of a move (v = the table version when the move starts)
-------------------------------------------------------------------
1. LOADING: LoadExperts on the target. RESOURCE_EXHAUSTED (over its memory
   budget) fails the move; nothing else has changed.
2. CHECKING: a canary, the same seeded hidden states [16, hidden] sent to the
   source and the target for this expert alone, must give the same partial sums
   (bit-equal in float32, within 1e-2 in bfloat16/float16).
3. SWITCHING: publish v+1 = the pair's replicas plus the target (make).
4. CONFIRMING: wait until v+1 is acknowledged.
5. RETIRING: publish v+2 = the replicas without the source (break).
6. DRAINING: wait until v+2 is drained from the source.
7. UNLOADING: UnloadExperts on the source.

Why make, acknowledge, then break (rather than one switch {source} -> {target}):
both orders keep every replica a router may use loaded until it is drained, but
only this one keeps the table truthful whatever goes wrong. At every moment the
live routers serve at most two adjacent versions, and both list a loaded
replica of the pair: during 3-4 they serve v ({source}) or v+1 ({source,
target}); the break is published only once nobody serves v any more, so during
5-6 they serve v+1 or v+2 ({target}), and the target is already known to all of
them. A router that never acknowledges v+1 leaves the table at {source, target}
with both loaded: nothing to roll back, nothing loaded but unlisted. A direct
switch stuck at the same point would leave {target} in the table and the source
loaded for a router that still uses it, weights the table no longer accounts
for. The source also keeps taking its share of traffic next to the target
until every router has the target, rather than handing all of it over at once.

Replicate stops after SWITCHING (both stay). Evict is RETIRING, DRAINING and
UNLOADING of one replica, refused when it is the pair's last; no table this
package publishes leaves any pair without a replica.

Failures
--------
Before the switch (the table never listed the target) the target is unloaded
again, unless it held the expert before the move began, and the table stays at
v: FAILED. After the switch nothing is unloaded (some router may still use
it); the pair's entry is repaired to list exactly the replicas that hold the
expert: the source is listed again if it still holds it (Describe), the target
is dropped if it lost it. When that restores the entry as it was before the
move the result is ROLLED_BACK (shares restored too), otherwise FAILED with the
table serving from what is loaded. Every phase change is persisted, so a
restarted orchestrator resumes half-done migrations (``resume_all``).
"""

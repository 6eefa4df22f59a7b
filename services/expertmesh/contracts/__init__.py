"""What the processes agree on: the tensor codec and dispatch frames, the shared buffer, errors, the routing table
and the group map, the GPU plan and topology file formats, and the load window.

Glossary:
- *group map* (``group_map.GroupPlacement``): which expert group hosts which logical experts.
- *GPU plan* (``gpu_plan.Placement``): which GPU holds each replica of each (layer, expert), and its share:
  ``expertmesh plan``'s output.
- *routing table* (``routing_table.RoutingTable``): the versioned (layer, expert) -> groups map the routers serve by.
- *topology* (``topology.Topology``): nodes -> NUMA nodes -> NVLink islands -> GPUs.

Imports nothing of expertmesh but itself and the generated ``expertmesh.v1`` messages (the import-linter
layers keep it so); the expert-group client, which needs TLS and telemetry, is ``infra.group_channels``."""

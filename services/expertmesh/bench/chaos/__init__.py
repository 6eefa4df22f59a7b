"""The chaos benchmark's parts (``expertmesh bench chaos``, in ``suite``):
``platform`` (the processes of a cluster-shaped deployment on this machine, each one a fault
can reach), ``traffic`` (streaming clients and what each request got), ``faults`` (inject one
fault, watch the platform react, lift it, wait until it is whole again) and ``measure`` (pure:
requests and token arrivals -> each scenario's counts and throughput). Across hosts
(``bench chaos --hosts``): ``hosts`` (test hosts as network namespaces on one switch),
``hosts_platform`` (the platform with each process on a host of its own) and ``host_faults``
(a host's link down, cut off or killed; the watch for experts left without a replica).

Glossary
--------
scenario
    One fault under load: a quiet window before it, the injection, ``hold_s`` with the fault
    in place (or longer, while what it sets off runs its course), the fault lifted, and the
    wait until the platform is whole again (``recovered``).
reference
    Each prompt's greedy completion, served by the same platform one request at a time before
    any fault. Every completion under load is compared with it token for token.
wrong output
    A completion that returned OK yet differs from its reference. The product promises none,
    with one exception it cannot avoid: between the moment an expert's weights are corrupted
    and the moment the routers stop using that replica, its outputs are wrong and look fine;
    those are counted apart (``wrong_before_quarantine``), see ``measure``.
unhosted expert
    A (layer, expert) that a routing table read during a scenario gives no group (``--hosts``):
    tokens routed to it have nowhere to go. The platform promises none, whatever a host does.
degraded output
    A completion served while routers fall back around an expert whose every replica is
    quarantined (the ``quarantine_fallback``): it may differ from the reference by design.
"""

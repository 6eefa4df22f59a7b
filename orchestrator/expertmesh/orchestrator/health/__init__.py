"""Expert health: probe every replica of every expert, quarantine the ones that
compute wrong, repair them from the checkpoint, and put them back.

Split like ``orchestrator.drift``: ``state`` (records, checks, findings: plain
data, persisted in the state store), ``probes`` (the probe inputs: recorded or
seeded, pinned in the store), ``measure`` (probe batches, histograms, KL,
distances between replicas: pure), ``policy`` (findings, the state machine and
the routing-table edit: pure), ``sampling`` (which layers a round probes within
``round_probe_rows``: pure), ``reference`` (an expert's output computed here
from the checkpoint with stock transformers), ``monitor`` (the I/O: one round,
the operator's quarantine and release, the loop, the gauges), ``anomalies``
(early rounds on the experts routers' anomaly records implicate), ``config``
(``EXPERTMESH_HEALTH_*``), ``api`` (records as the admin API's messages) and
``cli`` (``expertmesh experts``, ``quarantine``, ``release``).

Glossary
--------
replica
    One group holding one (layer, expert) (``ReplicaId``). Health is judged per
    replica: one copy of an expert can go bad while the others stay sound.
probe
    Per MoE layer, up to ``tokens`` hidden states [T, H] that every replica of
    every expert of the layer computes in a check, alone at weight 1 (one
    Dispatch per group per layer for all its experts, routing-table version 0,
    which migrations' drains ignore), so the partial sums are each expert's own
    output. Recorded when routers sample their traffic
    (``EXPERTMESH_HIDDEN_SAMPLE_TOKENS``, ``router.hidden_sample``): a sample is
    pinned and reused round after round, so a healthy replica's figures do not
    move at all (a KL of exactly 0 on one device) and every change is the
    weights', and re-pinned every ``probe_refresh_s`` over a layer judged healthy.
    Seeded standard-normal states (seed + layer) where no router records any:
    RMS 1 per row, what the normalisation before each MoE block produces before
    its per-channel weights, not the distribution real traffic brings. Each
    check says which it used (``probe_source``). ``probes`` has the details.
fingerprint
    A checksum of one expert's weights that its group takes when it reads them
    from disk and recomputes on demand (``expert_group.fingerprint``, the
    ``Fingerprint`` RPC). A mismatch means its memory was overwritten.
baseline
    A replica's probe output summarised (mean output norm, histograms of the
    output-row norms and of the output values on bins at their own quantiles),
    taken at its first clean check after it was loaded and again from the
    verified output of a repair. Stored on the replica's record with the
    load-time fingerprint it describes; weights loaded anew need a new one.
KL
    KL(baseline || now) of the probe's histograms, on the baseline's bins with
    half a count of smoothing per bin; the larger of the norm and the value
    histograms. ``expertmesh.expert.kl``.
deviation
    How far one replica's output norms on the probe are from the median over
    the expert's replicas, relative to that median's mean.
finding
    What a check shows against a threshold, with its severity (suspect, or
    quarantine at once); ``policy`` lists them.
quarantined / probation
    Out of service: routers send it no tokens. With another replica in service
    the routing table stops listing it (a table edit, no quality change); as
    the expert's last listed replica it stays listed (a table never leaves an
    expert unhosted) and routers fall back for that expert. Either way the
    state store's ``quarantine`` hash names it (``expertmesh.store.QuarantinedReplica``).
    Probation follows a repair: reloaded from the checkpoint and verified against
    ``reference`` on the probe, it must pass ``probation_checks`` clean checks
    before it serves again (and is listed again if the monitor had withdrawn it).
withdrawn
    A replica the monitor took out of the routing table; it goes back once healthy.

States and findings are in ``policy``'s docstring.
"""

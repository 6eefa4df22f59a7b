"""The capacity controller: redundant replicas of hot experts placed and cold ones retired within the groups'
memory budgets, and groups asked for or given back as the cluster stays busy or idle (issue 42's "capacity
controller", EPLB's redundant experts made live).

Split: ``config`` (the settings), ``policy`` (one observation and the last scan's memory -> this scan's decisions:
pure), ``controller`` (the control loop's manager: observes as drift does, submits replicate and evict migrations,
logs every decision with its reason).

Glossary
- *layer load*: tokens that chose each expert of a MoE layer over the routers' load windows (drift's observation).
- *replica load*: an expert's load over its replicas (the routers split a replicated expert's tokens evenly).
- *group load* of a layer: the sum of the replica loads a group serves in it; *layer balancedness*: mean over max
  of the groups' loads in the layer (``placement.quality``), 1.0 when even.
- *hot group* of a layer: the one with the largest group load; a *replicate* gives its heaviest expert that can
  go somewhere one more replica, on the layer's least-loaded group with memory room.
- *cold replica*: a replica of an expert with several whose replica load is under ``retire_below`` of the
  layer's mean expert load; a *retire* evicts it from the most loaded of its groups.
- *cluster busy*: the mean busy fraction of the groups since the last scan (Describe's busy-seconds counter);
  ``scans`` in a row above ``add_busy`` advise a group added, below ``remove_busy`` one removed.
"""

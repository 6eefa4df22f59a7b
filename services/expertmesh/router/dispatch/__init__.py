"""Remote experts: the routing view the router serves by, kept current from the store (``table_watcher``,
``heartbeat``), and each MoE layer's tokens sent to the groups that hold their experts (``dispatcher``,
``layer_plan``, ``replica_split``, ``circuit``, ``degraded``)."""

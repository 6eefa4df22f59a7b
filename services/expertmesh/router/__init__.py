"""The router: the model minus its routed experts, with every MoE layer's experts
call dispatched over gRPC to the expert groups (``dispatch``), built from a
checkpoint without materialising routed-expert weights (``model``)."""

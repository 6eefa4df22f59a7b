"""How one group's share of a MoE layer reaches it: the interface and unary gRPC (``base``), one stream
per group (``stream``), shared memory on one host (``local``) and the default that picks the fastest that works
(``auto``); ``base.build`` makes one by name."""

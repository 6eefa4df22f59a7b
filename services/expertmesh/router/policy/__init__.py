"""Per-request routing: the policies over the stock gate's scores, the gate hook that applies them,
expert capability profiles per query domain, and the quality guard."""

"""What the router reports: its load window to the store, samples of hidden states, wire traffic counters and its
OpenTelemetry metrics."""

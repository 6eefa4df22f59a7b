"""What every process runs on: the gRPC server and its interceptors, transport security, OpenTelemetry,
the console, devices and finite checks."""

"""Infrastructure every service stands on: gRPC server, NIXL agent, Redis state, metrics, processes."""

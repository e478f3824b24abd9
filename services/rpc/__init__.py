"""What every service process stands on: the asyncio gRPC server, request parsing, admission, health,
metrics, flags, addresses."""

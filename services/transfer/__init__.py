"""The KV data plane: the NIXL agent, transfer descriptors, and the wire forms of KV layouts and NIXL peers."""

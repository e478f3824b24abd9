"""Cluster state in Redis: instance registry, load, prefix-block index, KV events; a private redis-server
when none answers."""

"""KV transfer, in one place: the NIXL agent and descriptors, export of a held request's KV (prefill),
pull into a decode engine, the kvstore link and prefix load / offload, and the CP staging through rank 0.
The engine only says which bytes a request's KV is (engine/kv/export.py); this package moves them."""

"""HiSparse decode benchmark (`python -m bench.hisparse`): the real-dimension layer stack, the stepped cases,
the host-time breakdown."""

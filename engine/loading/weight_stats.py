"""What a rank's weights take, by dtype, and what loading them read: reported by the engine itself
(`LLM.get_stats().weight_bytes`, the services' /metrics) and computed by `pdserve plan` on a model built
on the `meta` device (sizes without memory)."""

from __future__ import annotations

from torch import nn


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer, by dtype name (e.g. {'bfloat16': ..., 'float8_e4m3fn': ...})."""
    out: dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return dict(sorted(out.items()))


def rank_weight_report(runner) -> dict:
    """One rank's weights: bytes by dtype and, when loaded from a checkpoint, what the loader read
    (callable as a multi-rank RPC: runner first)."""
    model = runner.model
    report = {"weight_bytes": weight_bytes_by_dtype(model)}
    load = getattr(model, "load_report", None)
    if load is not None:
        report["load"] = {"bytes_read": load.bytes_read, "tensors_read": len(load.names_read),
                          "peak_tensor_bytes": load.peak_tensor_bytes, "staging_bytes": load.staging_bytes,
                          "names_read": list(load.names_read)}
    return report

"""Loading HF safetensors checkpoints into `GlmDsaForCausalLM`.

Handles a single file or shards indexed by `model.safetensors.index.json`; bf16/fp32 weights and fp8
e4m3 weights with 128x128 block scales (`weight_scale_inv`, dequantised on the CPU at load); experts as
per-expert tensors (`experts.{e}.gate_proj.weight`) or HF's merged 3-D tensors (`experts.gate_up_proj`);
the MTP layer stored as `model.layers.{num_hidden_layers}.*`. Every parameter must be covered exactly:
a missing or mis-shaped tensor is a `WeightLoadError` naming it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config.model import ModelConfig

log = logging.getLogger(__name__)

FP32_PARAMS = ("e_score_correction_bias", "indexer.weights_proj.weight")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MERGED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# MTP tensors that duplicate the main model's (DeepSeek checkpoints store them): shared, not loaded twice.
_MTP_SHARED = ("embed_tokens.", "shared_head.head.")


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor."""


@dataclass
class LoadReport:
    loaded: int = 0
    ignored: list[str] = field(default_factory=list)


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors files in {path}")
    for f in files:
        if not f.exists():
            raise WeightLoadError(f"checkpoint index names {f.name}, which is missing from {path}")
    return files


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight, fp8 block-scaled weights dequantised to fp32."""
    files = checkpoint_files(path)
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                where[k] = f
    for name, f in where.items():
        if name.endswith("_scale_inv"):
            continue
        with safe_open(str(f), framework="pt") as h:
            t = h.get_tensor(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + "_scale_inv"
            if scale_name not in where:
                raise WeightLoadError(f"fp8 tensor {name} has no {scale_name} block scales")
            with safe_open(str(where[scale_name]), framework="pt") as h:
                t = dequantize_block_fp8(t, h.get_tensor(scale_name))
        yield name, t


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp8 [..., rows, cols] with scales [..., ceil(rows/br), ceil(cols/bc)] -> fp32."""
    rows, cols = w.shape[-2:]
    sr, sc = scale_inv.shape[-2:]
    br, bc = -(-rows // sr), -(-cols // sc)
    s = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return w.float() * s


def _target(name: str, cfg: ModelConfig) -> tuple[str, tuple] | None:
    """Checkpoint name -> (our parameter name, where in it) or None to ignore."""
    if "rotary_emb" in name:
        return None
    mtp_prefix = f"model.layers.{cfg.mtp_layer_index}."
    if name.startswith(mtp_prefix):
        rest = name[len(mtp_prefix):]
        if rest.startswith(_MTP_SHARED):
            return None
        name = "mtp." + rest if rest.startswith(_MTP_OWN) else "mtp.layer." + rest
    m = _EXPERT.match(name)
    if m:
        which = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}[m.group(3)]
        return f"{m.group(1)}.{which[0]}", ("expert", int(m.group(2)), which[1])
    m = _MERGED.match(name)
    if m:
        return f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", ("all",)
    return name, ("whole",)


def load_weights(model: nn.Module, path: str | Path, cfg: ModelConfig) -> LoadReport:
    """Copy every checkpoint tensor into `model` (already on its device); verify full coverage."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    covered: dict[str, set] = {n: set() for n in params}
    report = LoadReport()
    for name, tensor in iter_checkpoint(path):
        tgt = _target(name, cfg)
        if tgt is None:
            continue
        if tgt[0] not in params:
            served_without_mtp = tgt[0].startswith("mtp.") and getattr(model, "mtp", None) is None
            if not served_without_mtp:
                report.ignored.append(name)
            continue
        pname, where = tgt
        _copy_into(params[pname], tensor, where, name, pname, model, covered[pname])
        report.loaded += 1
    _check_coverage(params, covered)
    if report.ignored:
        log.warning("ignored %d checkpoint tensors the model has no place for, e.g. %s",
                    len(report.ignored), report.ignored[:3])
    return report


def _experts_module(model: nn.Module, pname: str) -> nn.Module:
    return model.get_submodule(pname.rsplit(".", 1)[0])


def _copy_into(dst: torch.Tensor, src: torch.Tensor, where: tuple, ckpt_name: str, pname: str,
               model: nn.Module, covered: set) -> None:
    if where[0] == "whole":
        view, key = dst, "whole"
    else:
        experts = _experts_module(model, pname)
        offset, n_local = experts.offset, dst.shape[0]
        if where[0] == "all":
            src = src[offset: offset + n_local]
            view, key = dst, "all"
        else:
            local = where[1] - offset
            if not 0 <= local < n_local:
                return  # another expert-parallel rank owns this expert
            half = dst.shape[1] // 2
            view = dst[local] if where[2] is None else dst[local, where[2] * half:(where[2] + 1) * half]
            key = (local, where[2])
    if tuple(view.shape) != tuple(src.shape):
        raise WeightLoadError(f"{ckpt_name}: checkpoint shape {tuple(src.shape)} does not match the model's "
                              f"{tuple(view.shape)} for {pname} (wrong config.json for these weights?)")
    with torch.no_grad():
        view.copy_(src.to(dtype=view.dtype))
    covered.add(key)


def _check_coverage(params: dict[str, torch.Tensor], covered: dict[str, set]) -> None:
    missing = []
    for name, t in params.items():
        got = covered[name]
        if "whole" in got or "all" in got:
            continue
        if name.endswith((".w13", ".w2")) and got:
            parts = {None} if name.endswith(".w2") else {0, 1}
            if all((e, p) in got for e in range(t.shape[0]) for p in parts):
                continue
            absent = sorted({e for e in range(t.shape[0]) if any((e, p) not in got for p in parts)})
            missing.append(f"{name} (experts {absent[:8]}{'...' if len(absent) > 8 else ''})")
            continue
        missing.append(name)
    if missing:
        raise WeightLoadError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: "
                              + ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""))


def cast_model(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters to `dtype`, keeping the few that must stay fp32 (routing bias, indexer weights)."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        want = torch.float32 if name.endswith(FP32_PARAMS) else dtype
        if p.dtype != want and p.is_floating_point():
            p.data = p.data.to(want)


def to_hf_state_dict(model: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters under HF checkpoint names (per-expert tensors, MTP as layer N): the inverse of
    `load_weights`, used by the checkpoint writer."""
    out: dict[str, torch.Tensor] = {}
    mtp_prefix = f"model.layers.{cfg.mtp_layer_index}."
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("mtp.layer."):
            name = mtp_prefix + name[len("mtp.layer."):]
        elif name.startswith("mtp."):
            name = mtp_prefix + name[len("mtp."):]
        if name.endswith(".experts.w13"):
            base, half = name[: -len(".w13")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith(".experts.w2"):
            base = name[: -len(".w2")]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out

"""Loading HF safetensors checkpoints into `GlmDsaForCausalLM`.

Handles a single file or shards indexed by `model.safetensors.index.json`; bf16/fp32 weights and fp8
e4m3 weights with 128x128 block scales (`weight_scale_inv`, docs/fp8.md); experts as per-expert tensors
(`experts.{e}.gate_proj.weight`) or HF's merged 3-D tensors (`experts.gate_up_proj`); the MTP layer stored
as `model.layers.{num_hidden_layers}.*`. Every parameter must be covered exactly: a missing or
mis-shaped tensor, or scales that do not fit their weight, is a `WeightLoadError` naming it.

FP8 tensors go to the device as FP8 into FP8 parameters (the model's FP8 modules, engine/model/fp8.py);
an FP8 tensor the model keeps in its own dtype (a module the config lists as unquantized) is
dequantized on the device; a bf16 tensor
bound for an FP8 parameter is quantized on the device when the config asks (`quantize_at_load`).
Reading goes through engine.loading.weight_reader: only this rank's tensors, one at a time.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config.model_config import ModelConfig, hf_name
from engine.loading.weight_reader import ShardReader, TensorInfo, WeightLoadError, checkpoint_files, read_index
from kernels.fp8_quant import dequantize_weight_ref, quantize_weight_ref

__all__ = ["WeightLoadError", "checkpoint_files", "fp8_modules", "load_weights", "to_hf_state_dict"]

log = logging.getLogger(__name__)

FP32_PARAMS = ("e_score_correction_bias", "indexer.weights_proj.weight", "_scale_inv")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
SCALE = "_scale_inv"
_MERGED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# MTP tensors that duplicate the main model's (DeepSeek checkpoints store them): shared, not loaded twice.
_MTP_SHARED = ("embed_tokens.", "shared_head.head.")


@dataclass
class LoadReport:
    loaded: int = 0
    ignored: list[str] = field(default_factory=list)
    bytes_read: int = 0
    names_read: list[str] = field(default_factory=list)
    peak_tensor_bytes: int = 0  # the largest single tensor held in host memory (plus the staging buffer)
    staging_bytes: int = 0


@dataclass(frozen=True)
class _Item:
    name: str  # checkpoint tensor
    pname: str  # our parameter
    where: tuple
    rows: slice | None  # merged experts: this rank's expert range, read alone


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


def fp8_modules(index: dict[str, TensorInfo]) -> set[str]:
    """The checkpoint's modules whose weights are stored in FP8, by checkpoint name (routed experts as
    `...mlp.experts`, from per-expert or merged tensors): which modules the model keeps in FP8 when the
    config does not list them (engine/model/fp8.py)."""
    out = set()
    for name, info in index.items():
        if not info.is_fp8 or name.endswith(SCALE):
            continue
        m = _EXPERT.match(name) or _MERGED.match(name)
        out.add(m.group(1) if m else name.removesuffix(".weight"))
    return out


def load_weights(model: nn.Module, path: str | Path, cfg: ModelConfig) -> LoadReport:
    """Copy the checkpoint tensors this model keeps into it (already on its device); verify full coverage.

    Only planned tensors are read (other ranks' experts are skipped by name, merged expert tensors are
    sliced to this rank's range before reading), shard by shard, each in its stored dtype."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    covered: dict[str, set] = {n: set() for n in params}
    index = read_index(path)
    _check_fp8_claim(cfg, index)
    plan, report = _plan(model, params, index, cfg)
    device = next(iter(params.values())).device
    staging = max((index[it.name].nbytes(it.rows) for it in plan), default=0) if device.type == "cuda" else 0
    reader = ShardReader(device, staging_bytes=staging)
    progress = LoadProgress(sum(index[it.name].nbytes(it.rows) for it in plan), len(plan))
    for file in sorted({index[it.name].file for it in plan}):
        with safe_open(str(file), framework="pt") as h:
            for it in (it for it in plan if index[it.name].file == file):
                src = reader.read(h, it.name, it.rows)
                scale = _read_scale(reader, index, it, src) if src.dtype == torch.float8_e4m3fn else None
                _place(params, it, src, scale, reader, cfg, covered)
                report.loaded += 1
                progress.update(reader.bytes_read, report.loaded)
    progress.done(reader.bytes_read, report.loaded)
    _check_coverage(params, covered)
    report.bytes_read, report.names_read = reader.bytes_read, reader.names_read
    report.peak_tensor_bytes, report.staging_bytes = reader.peak_tensor_bytes, staging
    if report.ignored:
        log.warning("ignored %d checkpoint tensors the model has no place for, e.g. %s",
                    len(report.ignored), report.ignored[:3])
    return report


PROGRESS_S = 10.0  # a load logs how far it is at most this often


class LoadProgress:
    """Log lines while a checkpoint loads (a 700 GB FP8 checkpoint takes minutes): bytes read of the planned
    total, the rate and the time left, at most every PROGRESS_S; then the total and the mean rate."""

    def __init__(self, total_bytes: int, total_tensors: int):
        self.total, self.tensors = max(total_bytes, 1), total_tensors
        self.t0 = self.last = time.monotonic()
        log.info("loading %d tensors, %.2f GiB", total_tensors, total_bytes / 2**30)

    def update(self, bytes_read: int, tensors: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_S:
            return
        self.last = now
        rate = bytes_read / max(now - self.t0, 1e-9)
        left = max(self.total - bytes_read, 0) / max(rate, 1.0)
        log.info("loading weights: %.2f of %.2f GiB (%.0f%%, %d of %d tensors), %.2f GiB/s, about %.0fs left",
                 bytes_read / 2**30, self.total / 2**30, 100 * min(bytes_read / self.total, 1.0), tensors,
                 self.tensors, rate / 2**30, left)

    def done(self, bytes_read: int, tensors: int) -> None:
        took = time.monotonic() - self.t0
        log.info("loaded %d tensors, %.2f GiB in %.1fs (%.2f GiB/s)", tensors, bytes_read / 2**30, took,
                 bytes_read / 2**30 / max(took, 1e-9))


def _check_fp8_claim(cfg: ModelConfig, index: dict[str, TensorInfo]) -> None:
    if cfg.quantization == "fp8" and not cfg.quantize_at_load and not any(n.endswith(SCALE) for n in index):
        raise WeightLoadError("config.json's quantization_config declares fp8 block-scaled weights, but the "
                              "checkpoint has no *_scale_inv tensors (a bf16 checkpoint? drop quantization_config, "
                              "or load it with --quantization fp8)")
    for name, info in index.items():
        if info.is_fp8 and not name.endswith(SCALE) and _scale_name(name) not in index:
            raise WeightLoadError(f"fp8 tensor {name} has no {_scale_name(name)} block scales")


def _scale_name(name: str) -> str:
    return name + SCALE  # x.weight -> x.weight_scale_inv; experts.gate_up_proj -> experts.gate_up_proj_scale_inv


def _plan(model: nn.Module, params: dict, index: dict[str, TensorInfo], cfg: ModelConfig):
    """The tensors to read, by name, before any is read: this rank's experts only."""
    report = LoadReport()
    plan = []
    for name in index:
        if name.endswith(SCALE):
            continue  # read beside its weight
        tgt = _target(name, cfg)
        if tgt is None:
            continue
        pname, where = tgt
        if pname not in params:
            if not (pname.startswith("mtp.") and getattr(model, "mtp", None) is None):
                report.ignored.append(name)
            continue
        rows = None
        if where[0] != "whole":
            experts = _experts_module(model, pname)
            n_local = params[pname].shape[0]
            if where[0] == "all":
                rows = slice(experts.offset, experts.offset + n_local)
            elif not 0 <= where[1] - experts.offset < n_local:
                continue  # another expert-parallel rank owns this expert: never read
            else:
                where = ("expert", where[1] - experts.offset, where[2])
        plan.append(_Item(name, pname, where, rows))
    return plan, report


def _read_scale(reader: ShardReader, index: dict[str, TensorInfo], it: _Item, w: torch.Tensor) -> torch.Tensor:
    name = _scale_name(it.name)
    with safe_open(str(index[name].file), framework="pt") as h:
        s = reader.read(h, name, it.rows)
    want = (*w.shape[:-2], -(-w.shape[-2] // 128), -(-w.shape[-1] // 128))
    if tuple(s.shape) != want or not s.is_floating_point():
        raise WeightLoadError(f"{name}: block scales of shape {tuple(s.shape)} ({s.dtype}) do not fit weight "
                              f"{it.name} {tuple(w.shape)}: 128x128 blocks need {want}")
    return s.float()


def _place(params: dict, it: _Item, src: torch.Tensor, scale: torch.Tensor | None, reader: ShardReader,
           cfg: ModelConfig, covered: dict[str, set]) -> None:
    """src (and its scales) -> the parameter, converting only where the model's dtype differs."""
    dst = params[it.pname]
    fp8_dst = dst.dtype == torch.float8_e4m3fn
    if fp8_dst and scale is None and not cfg.quantize_at_load:
        raise WeightLoadError(f"{it.name} is {src.dtype} in the checkpoint but the model keeps {it.pname} in FP8 "
                              "(quantize it at load with --quantization fp8, or list it in modules_to_not_convert)")
    view, key = _view(dst, it.where, src.shape, it.name, it.pname)
    dev_src = reader.to_device(src)
    with torch.no_grad():
        if fp8_dst:
            if scale is None:
                dev_src, scale_dev = quantize_weight_ref(dev_src)  # bf16 checkpoint quantized at load
            else:
                scale_dev = reader.to_device(scale)
            s_name = it.pname + SCALE
            s_view, _ = _view(params[s_name], it.where, scale_dev.shape, _scale_name(it.name), s_name)
            s_view.copy_(scale_dev)
            covered[s_name].add(key)
        elif scale is not None:  # an FP8 tensor the model keeps in its own dtype: dequantized on the device
            dev_src = dequantize_weight_ref(dev_src, reader.to_device(scale), view.dtype)
        view.copy_(dev_src)
    covered[it.pname].add(key)


def _experts_module(model: nn.Module, pname: str) -> nn.Module:
    return model.get_submodule(pname.rsplit(".", 1)[0])


def _view(dst: torch.Tensor, where: tuple, shape, ckpt_name: str, pname: str) -> tuple[torch.Tensor, object]:
    """The part of dst that a checkpoint tensor fills, and its coverage key; shapes must match."""
    if where[0] == "whole":
        view, key = dst, "whole"
    elif where[0] == "all":
        view, key = dst, "all"
    else:
        local = where[1]
        half = dst.shape[1] // 2
        view = dst[local] if where[2] is None else dst[local, where[2] * half:(where[2] + 1) * half]
        key = (local, where[2])
    if tuple(view.shape) != tuple(shape):
        raise WeightLoadError(f"{ckpt_name}: checkpoint shape {tuple(shape)} does not match the model's "
                              f"{tuple(view.shape)} for {pname} (wrong config.json for these weights?)")
    return view, key


def _check_coverage(params: dict[str, torch.Tensor], covered: dict[str, set]) -> None:
    missing = []
    for name, t in params.items():
        got = covered[name]
        if "whole" in got or "all" in got:
            continue
        if name.endswith((".w13", ".w2", ".w13" + SCALE, ".w2" + SCALE)) and got:
            parts = {None} if name.endswith((".w2", ".w2" + SCALE)) else {0, 1}
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
    """Our parameters under HF checkpoint names (per-expert tensors, MTP as layer N, FP8 experts' scales
    split per expert as `{gate,up,down}_proj.weight_scale_inv`): the inverse of `load_weights`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        name = hf_name(name, cfg)
        for suffix, part in ((".w13", ".weight"), (".w13" + SCALE, ".weight" + SCALE)):
            if name.endswith(".experts" + suffix):
                base, half = name[: -len(suffix)], t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}.{e}.gate_proj{part}"] = t[e, :half].contiguous()
                    out[f"{base}.{e}.up_proj{part}"] = t[e, half:].contiguous()
                break
        else:
            for suffix, part in ((".w2", ".weight"), (".w2" + SCALE, ".weight" + SCALE)):
                if name.endswith(".experts" + suffix):
                    base = name[: -len(suffix)]
                    for e in range(t.shape[0]):
                        out[f"{base}.{e}.down_proj{part}"] = t[e].contiguous()
                    break
            else:
                out[name] = t.contiguous()
    return out

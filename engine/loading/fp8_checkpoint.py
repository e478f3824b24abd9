"""Quantizing a checkpoint to FP8 block-scaled weights in the HF layout GLM-5-FP8 ships.

Every projection weight (2-D `*.weight` of a module the not-convert list does not name, and the routed
experts, written per expert even when the source merges them in 3-D tensors) becomes float8_e4m3fn plus
`weight_scale_inv` fp32 per 128x128 block;
embeddings, lm_head, norms, the router gate, the indexer's weights_proj and the MTP layer's eh_proj and
shared_head are copied as they are (engine/model/fp8.py: DEFAULT_NOT_CONVERT).
config.json gains `quantization_config` (quant_method fp8, e4m3, dynamic activations, [128, 128] blocks,
the modules_to_not_convert list used). Works shard by shard (one input shard in memory at a time) and
keeps the input's shard names; tokenizer and generation files are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loading.weight_reader import checkpoint_files
from engine.model.fp8 import DEFAULT_NOT_CONVERT, is_quantized_name
from kernels.fp8_quant import quantize_weight_ref

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_MERGED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def is_quantized_tensor(name: str, t: torch.Tensor, not_convert: tuple[str, ...]) -> bool:
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        return False
    return name.endswith(".weight") and t.dim() == 2 and is_quantized_name(name[: -len(".weight")], not_convert)


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's merged 3-D expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> GLM-5-FP8's
    per-expert names (`experts.{e}.{gate,up,down}_proj.weight`); each half keeps its own scale blocks."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(_MERGED_EXPERTS) and t.dim() == 3:
            base, which = name.rsplit(".", 1)
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                if which == "gate_up_proj":
                    out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = t[e, :half], t[e, half:]
                else:
                    out[f"{base}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def quantize_state(tensors: dict[str, torch.Tensor], not_convert: tuple[str, ...] = DEFAULT_NOT_CONVERT
                   ) -> dict[str, torch.Tensor]:
    """HF-named tensors -> the FP8 checkpoint's tensors (quantized weights gain `<name>_scale_inv`)."""
    out = {}
    for name, t in per_expert(tensors).items():
        if is_quantized_tensor(name, t, not_convert):
            out[name], out[name + "_scale_inv"] = quantize_weight_ref(t.contiguous())
        else:
            out[name] = t.contiguous()
    return out


def quantize_checkpoint(src: str | Path, dst: str | Path, not_convert: tuple[str, ...] = DEFAULT_NOT_CONVERT) -> Path:
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
        raise ValueError(f"{src} is already an fp8 checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for f in checkpoint_files(src):
        with safe_open(str(f), framework="pt") as h:
            part = quantize_state({k: h.get_tensor(k) for k in h.keys()}, not_convert)
        save_file(part, str(dst / f.name))
        weight_map.update({k: f.name for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    if (src / "model.safetensors.index.json").exists():
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    config["quantization_config"] = {**QUANT_CONFIG, "modules_to_not_convert": list(not_convert)}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst

"""`pdserve make-checkpoint`: a random-weight checkpoint in HF layout (no transformers needed).

Writes config.json, safetensors (optionally sharded with model.safetensors.index.json), and a
byte-level BPE tokenizer.json trained on a fixed corpus, so tests and the demo run anywhere.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from engine.config.model_config import ModelConfig
from engine.config.presets import PRESETS, preset_dict
from engine.loading.fp8_checkpoint import quantize_checkpoint
from engine.loading.loader import build_model
from engine.loading.weights import to_hf_state_dict

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]

# A random checkpoint's chat template: `<|role|>\ncontent\n` per message, then `<|assistant|>\n`.
SIMPLE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def init_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or ".k_norm.weight" in name \
                    or name.endswith(("enorm.weight", "hnorm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _corpus() -> list[str]:
    """Deterministic training text: this package's own sources."""
    root = Path(__file__).resolve().parents[1]  # the engine package
    return [p.read_text() for p in sorted(root.rglob("*.py"))]


def train_tokenizer(vocab_size: int, out_dir: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[0], "pad_token": SPECIAL_TOKENS[0],
        "bos_token": None, "chat_template": SIMPLE_CHAT_TEMPLATE}, indent=1))


def make_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, num_shards: int = 1,
                    dtype: str = "float32", **overrides) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = preset_dict(preset, **overrides)
    d["dtype"] = dtype
    cfg = ModelConfig.from_hf_dict(d)
    if cfg.vocab_size < 260:
        raise ValueError("vocab_size must be >= 260 (256 byte tokens + 4 special tokens)")
    model = build_model(cfg, device="cpu", dtype=torch.float32, with_mtp=True)
    init_random_weights(model, seed)
    tensors = {k: v.to(getattr(torch, dtype)) if not k.endswith("e_score_correction_bias") else v
               for k, v in to_hf_state_dict(model, cfg).items()}
    _save_shards(tensors, out, num_shards)
    hf = cfg.to_hf_dict()
    hf.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    train_tokenizer(cfg.vocab_size, out)
    return out


def _save_shards(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    names = sorted(tensors)
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"))
        return
    weight_map = {}
    for i in range(num_shards):
        part = names[i::num_shards]
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(out / fname))
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))


def main(argv: list[str]) -> int:
    """`pdserve make-checkpoint --preset tiny --out DIR --seed N [--shards K] [--set key=value ...]`."""
    p = argparse.ArgumentParser(prog="pdserve make-checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weight-dtype", default=None, choices=["float32", "bfloat16", "fp8"],
                   help="fp8: FP8 block-scaled projections in GLM-5-FP8's layout (default: --dtype)")
    p.add_argument("--from", dest="source", default=None, metavar="DIR",
                   help="quantize this existing checkpoint (with --weight-dtype fp8) instead of random weights")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value), e.g. --set index_topk=8")
    a = p.parse_args(argv)
    overrides = {}
    for item in a.set:
        key, sep, raw = item.partition("=")
        if not sep:
            p.error(f"--set needs KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    if a.preset != "tiny" and "num_hidden_layers" not in overrides:
        p.error("only the tiny preset is small enough to write with random weights (override num_hidden_layers etc.)")
    if a.source is not None or a.weight_dtype == "fp8":
        return _write_fp8(p, a, overrides)
    out = make_checkpoint(a.out, preset=a.preset, seed=a.seed, num_shards=a.shards, dtype=a.weight_dtype or a.dtype,
                          **overrides)
    print(f"wrote {out}")
    return 0


def _write_fp8(p, a, overrides: dict) -> int:
    """`--weight-dtype fp8 [--from DIR]`: quantize DIR (or a fresh random bf16 checkpoint) to FP8."""
    if a.weight_dtype != "fp8":
        p.error("--from quantizes an existing checkpoint: pass --weight-dtype fp8")
    if a.source is not None:
        out = quantize_checkpoint(a.source, a.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            src = make_checkpoint(tmp, preset=a.preset, seed=a.seed, num_shards=a.shards, dtype="bfloat16", **overrides)
            out = quantize_checkpoint(src, a.out)
    print(f"wrote {out} (fp8 block-scaled)")
    return 0

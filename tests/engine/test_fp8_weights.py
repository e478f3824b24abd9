"""FP8 block-scaled weights end to end on CPU: the trained tiny-code checkpoint quantized to GLM-5-FP8's
HF layout (by `pdserve make-checkpoint --weight-dtype fp8` and, independently, by this test), loaded with
its weights kept in FP8, against the unquantized model over held-out Python; loader errors; expert-
parallel ranks reading only their own experts, one tensor at a time.

Quality (teacher-forced, 1,024 tokens of tests/data/heldout_python.txt, a project source file the model
never saw): measured top-1 agreement 0.932 and mean logit cosine 0.9990 (w8a8: activations quantized per
token per 128 channels); weights-only FP8 gives 0.955 / 0.9993 on the same text. The test asserts 0.92 and
0.998: on eleven other Python texts w8a8 agreement ranged 0.916-0.946. The 0.95 target is missed by e4m3's
precision on this model, not by the arithmetic (bf16 compute alone agrees 0.970; the per-module ablation
and the reading are in docs/fp8.md); test_codes_are_the_nearest_e4m3_values pins the arithmetic.
"""

from __future__ import annotations

import json
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.loading.weights import WeightLoadError
from kernels.fp8_quant import dequantize_weight_ref

DATA = Path(__file__).resolve().parent.parent / "data" / "heldout_python.txt"
PROJ = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk",
        "gate_proj", "up_proj", "down_proj")  # not the MTP layer's eh_proj: GLM-5-FP8 ships it in bf16


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format written out block by block (independent of kernels.fp8_gemm)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // 128), -(-k // 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            s[i, j] = blk.abs().max().clamp(min=1e-10) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


@pytest.fixture(scope="module")
def fp8_tool(tiny_code, tmp_path_factory) -> Path:
    from engine.loading.checkpoint import main

    out = tmp_path_factory.mktemp("fp8tool") / "ckpt"
    assert main(["--from", str(tiny_code), "--weight-dtype", "fp8", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def fp8_own(tiny_code, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8own")
    sd = {}
    for f in sorted(tiny_code.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    for name in [n for n in sd if n.endswith(".weight") and any(f".{p}." in n for p in PROJ)]:
        sd[name], sd[name + "_scale_inv"] = _quantize_blocks(sd[name])
    save_file(sd, str(out / "model.safetensors"))
    cfg = json.loads((tiny_code / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_code / extra, out / extra)
    return out


@pytest.fixture(scope="module")
def heldout(tiny_code) -> list[int]:
    ids = LLM(str(tiny_code), num_blocks=8).tokenizer.encode(DATA.read_text())
    assert len(ids) >= 1024
    return ids


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_tool_and_independent_writer_agree(fp8_tool, fp8_own):
    a, b = _all_tensors(fp8_tool), _all_tensors(fp8_own)
    assert a.keys() == b.keys()
    scales = [n for n in a if n.endswith("weight_scale_inv")]
    assert len(scales) == sum(a[n[: -len("_scale_inv")]].dtype == torch.float8_e4m3fn for n in scales) > 50
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.float8_e4m3fn else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == torch.float8_e4m3fn else b[name]), name
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.indexer.weights_proj.weight", "model.norm.weight",
                 "model.layers.4.eh_proj.weight"):
        assert a[kept].dtype == torch.bfloat16, kept
    assert a["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert json.loads((fp8_tool / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("which", ["tool", "own"])
def test_weights_stay_fp8(which, fp8_tool, fp8_own):
    path = fp8_tool if which == "tool" else fp8_own
    llm = LLM(str(path), num_blocks=8)
    (wb,) = llm.get_stats().weight_bytes
    fp8_in_ckpt = sum(t.numel() for t in _all_tensors(path).values() if t.dtype == torch.float8_e4m3fn)
    assert wb["float8_e4m3fn"] == fp8_in_ckpt, "every FP8 tensor of the checkpoint stays FP8 in memory"
    model = llm.core.runner.model
    layer = model.model.layers[1]
    assert type(layer.self_attn.q_b_proj).__name__ == "Fp8Linear" and layer.mlp.experts.w2.dtype == torch.float8_e4m3fn
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn  # absorbed matmuls read FP8 (docs/fp8.md)
    assert model.lm_head.weight.dtype == torch.float32 and layer.mlp.gate.weight.dtype == torch.float32


def _close_to_unquantized(base: LLM, fp8: LLM, ids: list[int]) -> tuple[float, float]:
    a, b = fp8.prompt_logits(ids[:1024]).float().cpu(), base.prompt_logits(ids[:1024]).float().cpu()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    return top1, cos


def test_teacher_forced_close_to_unquantized(tiny_code, fp8_tool, heldout):
    top1, cos = _close_to_unquantized(LLM(str(tiny_code), num_blocks=24), LLM(str(fp8_tool), num_blocks=24), heldout)
    print(f"\nFP8 w8a8 vs unquantized tiny-code over 1024 held-out tokens: top-1 {top1:.4f}, cosine {cos:.5f}")
    assert top1 >= 0.92 and cos >= 0.998, (top1, cos)


def test_quantize_at_load_equals_fp8_checkpoint(tiny_code, fp8_tool, heldout):
    ids = heldout[:200]
    at_load = LLM(str(tiny_code), num_blocks=8, quantization="fp8")
    assert at_load.get_stats().weight_bytes[0]["float8_e4m3fn"] > 0
    assert torch.equal(at_load.prompt_logits(ids), LLM(str(fp8_tool), num_blocks=8).prompt_logits(ids))


def test_mtp3_acceptance_close_to_unquantized(tiny_code, fp8_tool, heldout):
    prompts = [heldout[i * 60: i * 60 + 32] for i in range(16)]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    lengths = []
    for path in (tiny_code, fp8_tool):
        llm = LLM(str(path), num_blocks=256, num_speculative_tokens=3)
        llm.generate(prompts, sp)
        lengths.append(llm.get_stats().spec_mean_acceptance_length)
    print(f"\nMTP3 mean acceptance length: unquantized {lengths[0]:.3f}, FP8 {lengths[1]:.3f}")
    assert abs(lengths[1] - lengths[0]) <= 0.05 * lengths[0], lengths


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model-00001-of-00002.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f))
    return dst


def test_bad_scales_are_named(fp8_tool, tmp_path):
    name = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    bad = _broken(fp8_tool, tmp_path / "shape", lambda sd: sd.__setitem__(name, torch.ones(3, 1)))
    with pytest.raises(WeightLoadError, match=re.escape(name) + r".*\(3, 1\)"):
        LLM(str(bad), num_blocks=8)
    gone = _broken(fp8_tool, tmp_path / "gone", lambda sd: sd.pop(name))
    with pytest.raises(WeightLoadError, match=r"fp8 tensor model\.layers\.1\.self_attn\.q_a_proj\.weight has no"):
        LLM(str(gone), num_blocks=8)


def test_fp8_claim_without_scales_is_an_error(tiny_code, tmp_path):
    out = tmp_path / "claim"
    shutil.copytree(tiny_code, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="no \\*_scale_inv tensors"):
        LLM(str(out), num_blocks=8)


def test_config_without_a_list_follows_the_checkpoint(fp8_tool, tmp_path, heldout):
    """DeepSeek-V3-style configs name no unquantized modules: the tensors' dtypes decide. Here layer 1's
    q_a_proj is stored in bf16 too, which the model then keeps unquantized (a hard-coded default list
    would make that an FP8 parameter without scales: a load error)."""
    name = "model.layers.1.self_attn.q_a_proj.weight"

    def to_bf16(sd):
        sd[name] = dequantize_weight_ref(sd[name], sd.pop(name + "_scale_inv"), torch.bfloat16)

    out = _broken(fp8_tool, tmp_path / "nolist", to_bf16)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]["modules_to_not_convert"]
    (out / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(out), num_blocks=8)
    model = llm.core.runner.model
    assert type(model.model.layers[1].self_attn.q_a_proj) is torch.nn.Linear
    assert type(model.model.layers[2].self_attn.q_a_proj).__name__ == "Fp8Linear"
    assert type(model.mtp.eh_proj) is torch.nn.Linear and model.model.layers[1].mlp.experts.fp8
    fp8_in_ckpt = sum(t.numel() for t in _all_tensors(out).values() if t.dtype == torch.float8_e4m3fn)
    assert llm.get_stats().weight_bytes[0]["float8_e4m3fn"] == fp8_in_ckpt
    a, b = llm.prompt_logits(heldout[:64]), LLM(str(fp8_tool), num_blocks=8).prompt_logits(heldout[:64])
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() > 0.9995


def test_codes_are_the_nearest_e4m3_values(tiny_code, fp8_tool):
    """Every stored weight is its bf16 source rounded to the nearest e4m3 value of its block's scale
    (max|w| / 448): error within half a step everywhere, RMS relative error at e4m3's floor (~2.6%)."""
    src, q = _all_tensors(tiny_code), _all_tensors(fp8_tool)
    for name, w in q.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        s = q[name + "_scale_inv"].double().repeat_interleave(128, 0)[: w.shape[0]]
        s = s.repeat_interleave(128, 1)[:, : w.shape[1]]
        real, ref = w.double() * s, src[name].double()  # float64: exact products, ties stay ties
        step = torch.exp2(torch.floor(torch.log2((ref / s).abs().clamp(min=2.0 ** -6))) - 3) * s
        assert ((real - ref).abs() <= step / 2 * (1 + 1e-6)).all(), name
        assert torch.isclose(real.abs().amax(), ref.abs().amax()), name
        assert (real - ref).norm() / ref.norm() < 0.028, name


def _expected_bytes(path: Path, lo: int, hi: int) -> int:
    """Bytes of every tensor a rank holding experts [lo, hi) keeps, from the safetensors headers."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                m = re.search(r"\.experts\.(\d+)\.", name)
                if m and not lo <= int(m.group(1)) < hi:
                    continue
                sl = h.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[sl.get_dtype()]
    return total


def test_ep2_ranks_read_only_their_experts(fp8_tool):
    llm = LLM(str(fp8_tool), device="cpu", num_blocks=16, prefill_context_parallel_size=2, enable_expert_parallel=True)
    try:
        reports = llm.core.weight_reports()
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        llm.core.shutdown()
    assert len(reports) == 2
    for rank, rep in enumerate(reports):
        lo, hi = 4 * rank, 4 * rank + 4
        experts = {int(m.group(1)) for n in rep["load"]["names_read"] if (m := re.search(r"\.experts\.(\d+)\.", n))}
        assert experts == set(range(lo, hi)), f"rank {rank} read experts {sorted(experts)}"
        assert rep["load"]["bytes_read"] == _expected_bytes(fp8_tool, lo, hi)
        assert rep["weight_bytes"]["float8_e4m3fn"] < reports[0]["weight_bytes"]["float8_e4m3fn"] * 1.01


def test_loader_holds_one_tensor_at_a_time(fp8_tool, monkeypatch):
    """Counting the loader's reads from outside (a wrapped safe_open): bytes per rank and the peak of
    checkpoint tensors alive at once, which must stay within one shard (on CPU no staging buffer)."""
    from engine.config.model_config import ModelConfig
    from engine.loading import weights
    from engine.loading.loader import build_model

    live, peak, read = [0], [0], [0]

    class Counting:
        def __init__(self, path, framework):
            self.h = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def _track(self, t):
            n = t.numel() * t.element_size()
            read[0] += n
            live[0] += n
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda: live.__setitem__(0, live[0] - n))
            return t

        def get_tensor(self, name):
            return self._track(self.inner.get_tensor(name))

        def get_slice(self, name):
            outer = self

            class S:
                def __getitem__(self, idx):
                    return outer._track(outer.inner.get_slice(name)[idx])
            return S()

    monkeypatch.setattr(weights, "safe_open", Counting)
    cfg = ModelConfig.from_pretrained(fp8_tool)
    build_model(cfg, checkpoint=fp8_tool, expert_shard=(4, 4))
    assert read[0] == _expected_bytes(fp8_tool, 4, 8)
    largest_shard = max(f.stat().st_size for f in fp8_tool.glob("*.safetensors"))
    largest_tensor = max(t.numel() * t.element_size() for t in _all_tensors(fp8_tool).values())
    assert peak[0] <= largest_tensor * 2 <= largest_shard, (peak[0], largest_tensor, largest_shard)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_engine_on_cuda(fp8_tool, heldout):
    """The Triton path (w8a8 GEMMs, FP8 grouped MoE, FP8 absorbed matmuls, bf16 activations) against the
    CPU reference path of the same FP8 checkpoint (fp32 activations)."""
    gpu = LLM(str(fp8_tool), device="cuda", num_blocks=64, num_speculative_tokens=3)
    cpu = LLM(str(fp8_tool), num_blocks=24)
    ids = heldout[:512]
    top1, cos = _close_to_unquantized(cpu, gpu, ids)
    print(f"\nFP8 on CUDA (bf16) vs the CPU reference (fp32): top-1 {top1:.4f}, cosine {cos:.5f}")
    assert top1 >= 0.9 and cos >= 0.995, (top1, cos)
    assert gpu.core.runner.model.model.layers[1].mlp.experts.impl.__name__ == "fused_moe_fp8"
    out = gpu.generate([heldout[:32]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 32 and gpu.get_stats().spec_steps > 0


def test_merged_expert_fp8_layout_loads_and_slices(fp8_tool, tmp_path, heldout, monkeypatch):
    """HF's merged 3-D expert tensors in FP8 (gate_up_proj [E, 2I, H] + gate_up_proj_scale_inv): same logits
    as the per-expert layout, and an expert-parallel rank reads only its slice of them."""
    sd = _all_tensors(fp8_tool)
    layers = sorted({m.group(1) for n in sd if (m := re.match(r"(model\.layers\.\d+)\.mlp\.experts\.0\.", n))})
    for layer in layers:
        base = f"{layer}.mlp.experts"
        n = len({int(m.group(1)) for k in sd if (m := re.match(re.escape(base) + r"\.(\d+)\.", k))})
        for suffix in ("", "_scale_inv"):
            gate_up = [torch.cat([sd.pop(f"{base}.{e}.gate_proj.weight{suffix}"),
                                  sd.pop(f"{base}.{e}.up_proj.weight{suffix}")]) for e in range(n)]
            sd[f"{base}.gate_up_proj{suffix}"] = torch.stack(gate_up)
            sd[f"{base}.down_proj{suffix}"] = torch.stack([sd.pop(f"{base}.{e}.down_proj.weight{suffix}")
                                                           for e in range(n)])
    out = tmp_path / "merged"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp8_tool / extra, out / extra)
    ids = heldout[:100]
    ours = LLM(str(out), num_blocks=8).prompt_logits(ids)
    assert torch.equal(ours, LLM(str(fp8_tool), num_blocks=8).prompt_logits(ids))

    from engine.config.model_config import ModelConfig
    from engine.loading.loader import build_model

    model = build_model(ModelConfig.from_pretrained(out), checkpoint=out, expert_shard=(4, 4))
    rep = model.load_report
    ends = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
    merged = [k for k in sd if k.endswith(ends)]
    whole = sum(t.numel() * t.element_size() for k, t in sd.items() if k not in merged)
    half = sum(t[4:8].numel() * t.element_size() for k, t in sd.items() if k in merged)
    assert rep.bytes_read == whole + half, "a rank reads its 4 experts' rows of the merged tensors, nothing more"


def test_make_checkpoint_random_fp8(tmp_path):
    from engine.loading.checkpoint import main

    out = tmp_path / "rnd"
    assert main(["--preset", "tiny", "--weight-dtype", "fp8", "--out", str(out)]) == 0
    llm = LLM(str(out), num_blocks=8)
    assert llm.get_stats().weight_bytes[0]["float8_e4m3fn"] > 0
    gen = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(gen[0].token_ids) == 3
    dummy = LLM(str(out), num_blocks=8, load_format="dummy")  # random FP8 codes x scales (benchmarks)
    assert dummy.get_stats().weight_bytes == llm.get_stats().weight_bytes
    assert torch.isfinite(dummy.prompt_logits([5, 6, 7])).all()


def test_quantization_flag(tiny_code):
    import argparse

    from engine.config.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", str(tiny_code), "--quantization", "fp8"])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.model.quantization == "fp8" and cfg.model.quantize_at_load
    with pytest.raises(ValueError, match="quantization must be"):
        EngineArgs(model=str(tiny_code), quantization="int4").create_engine_config()

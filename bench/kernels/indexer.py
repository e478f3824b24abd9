"""The indexer (`indexer_topk`) old against new: `python -m bench.kernels --only indexer --out FILE`.

Cases (H = 32 index heads, D = 128, top-k 2,048, fp8 keys in a shuffled 64-token paged cache):
    prefill  T = 2,048 query rows at the end of an S-token context, S = 8K / 128K / 1M (one request)
    decode   B = 64 requests, one query row each at the end of its own 128K-token context

Each case times both implementations on the same inputs: "radix" (the legacy score kernel + the 5-pass
radix top-k) and "fused" (`kernels.indexer_fused` + `kernels.topk_threshold`), plus the parts of the fused
path alone (the score kernel; the selection over those scores), and checks that the two selections agree
(near-ties of the k-th score may flip under fp8 accumulation, so a few differences per row are allowed).

Floor: prefill max(bytes / copy, FLOPs / (2 x bf16 matmul)), FLOPs = 2·H·D per (row, causal key), bytes =
the key rows once + q + w + the output; decode the key bytes B·S·132 over the copy bandwidth ("% copy
on keys"). Both ceilings are measured first in the same run (`bench.kernels.timing.ceilings`).
`--sweep` also times score-kernel tiles at S = 128K and the decode case, then (`--sweep select` alone) the
selection's warps and scan step at S = 128K, 8K and decode, and uses the fastest.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from bench.kernels.timing import device_time, roofline_row, time_plain
from kernels.indexer import _prepare, indexer_topk, indexer_topk_ref, store_index_k
from kernels.indexer_fused import DECODE, PREFILL, FusedConfig, default_config, fused_scores, tile_tensor
from kernels.topk import topk_rows
from kernels.topk_threshold import num_maxima, topk_threshold_rows

H, D, BS = 32, 128, 64
ROW = D + 4


class Case:
    """Inputs of one case: requests with contexts `seq_lens`, `rows` query rows at the end of each."""

    def __init__(self, dev, seq_lens: list[int], rows: int, topk: int = 2048, seed: int = 0):
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.k = topk
        need = [-(-S // BS) for S in seq_lens]
        self.cache = torch.empty((sum(need), 1, BS, ROW), dtype=torch.uint8, device=dev)[:, 0]
        perm = torch.randperm(sum(need), device=dev, generator=gen, dtype=torch.int32)
        self.table = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32, device=dev)
        at = 0
        for b, n in enumerate(need):
            self.table[b, :n] = perm[at: at + n]
            at += n
        step = 1 << 20
        for s0 in range(0, sum(need) * BS, step):
            n = min(step, sum(need) * BS - s0)
            keys = torch.randn(n, D, device=dev, generator=gen)
            store_index_k(keys, self.cache, torch.arange(s0, s0 + n, device=dev))
        self.pos = torch.cat([torch.arange(S - rows, S, device=dev) for S in seq_lens])
        self.req = torch.arange(len(seq_lens), device=dev, dtype=torch.int32).repeat_interleave(rows)
        T = self.pos.shape[0]
        self.q = torch.randn(T, H, D, device=dev, generator=gen)
        self.w = torch.rand(T, H, device=dev, generator=gen) * 0.1
        self.S = max(seq_lens)
        self.qsl = list(range(0, T + 1, rows))
        self.seq_lens = seq_lens

    def select(self, impl: str, config: FusedConfig | None = None) -> torch.Tensor:
        return indexer_topk(self.q, self.w, self.cache, self.table, self.req, self.pos, self.k, return_slots=False,
                            max_seq_len=self.S, query_start_loc_cpu=self.qsl, seq_lens_cpu=self.seq_lens, impl=impl,
                            config=config)


def _agreement(a: torch.Tensor, b: torch.Tensor, rows: int = 16) -> float:
    """Mean fraction of the selected positions two selections share, over their first rows."""
    shared = []
    for x, y in zip(a[:rows].tolist(), b[:rows].tolist()):
        sx, sy = {v for v in x if v >= 0}, {v for v in y if v >= 0}
        shared.append(len(sx & sy) / max(len(sx), 1))
    return sum(shared) / len(shared)


def _score_outputs(dev, case: Case, cfg: FusedConfig, rows: int):
    """(launch of the fused score kernel, scores, gmax) over the first `rows` query rows; the launch fills them."""
    q, w, _ = _prepare(case.q, case.w, case.cache, None)
    block_t = 1 if len(case.qsl) - 1 == q.shape[0] else cfg.block_t
    scores = torch.empty((rows, case.S), dtype=torch.float32, device=dev)
    gmax = torch.empty((rows, num_maxima(case.S, cfg.select)), dtype=torch.float32, device=dev)
    tiles = tile_tensor(0, rows, case.qsl, case.seq_lens, case.k, block_t, dev)
    launch = functools.partial(fused_scores, q, w, case.cache, case.table, case.req, case.pos, tiles, scores, gmax,
                               0, block_t, cfg)
    return launch, scores, gmax


def _fused_parts(dev, case: Case, cfg: FusedConfig) -> tuple[float, float]:
    """Seconds of the fused score kernel and of the threshold selection alone over the first chunk of rows."""
    T = case.pos.shape[0]
    rows = min(T, max(cfg.block_t, (1 << 30) // (4 * case.S)))
    launch, scores, gmax = _score_outputs(dev, case, cfg, rows)
    t_scores = time_plain(launch, dev, rep_ms=100)
    out = torch.empty((T, case.k), dtype=torch.int32, device=dev)
    t_select = time_plain(lambda: topk_threshold_rows(scores, gmax, case.pos, case.k, out, 0, cfg.select), dev,
                          rep_ms=100)
    return t_scores * T / rows, t_select * T / rows


def _radix_topk_time(dev, case: Case) -> float:
    """Seconds of the radix top-k alone over [rows, S] fp32 scores (random), scaled to all rows."""
    T = case.pos.shape[0]
    chunk = min(T, (1 << 30) // (4 * case.S))
    scores = torch.randn(chunk, case.S, device=dev)
    out = torch.empty(T, case.k, dtype=torch.int32, device=dev)
    return time_plain(lambda: topk_rows(scores, case.pos, case.k, out, 0), dev, rep_ms=100) * T / chunk


def bench_prefill(dev, ceil, S: int, T: int, ref_rows: int, config: FusedConfig | None, topk: int = 2048) -> list[dict]:
    case = Case(dev, [S], T, topk)
    cfg = config or default_config(case.qsl)
    flops = 2 * H * D * int((case.pos + 1).sum())
    bytes_min = S * ROW + case.q.numel() * 4 + case.w.numel() * 4 + T * topk * 4
    n = min(T, ref_rows)
    t_ref = time_plain(lambda: indexer_topk_ref(case.q[:n], case.w[:n], case.cache, case.table, case.req[:n],
                                                case.pos[:n], topk, return_slots=False), dev, rep_ms=50) * T / n
    t_old = time_plain(lambda: case.select("radix"), dev, rep_ms=200)
    t_old_topk = _radix_topk_time(dev, case)
    t_new = time_plain(lambda: case.select("fused", cfg), dev, rep_ms=200)
    t_dev, kernels = device_time(lambda: case.select("fused", cfg), dev)
    t_scores, t_select = _fused_parts(dev, case, cfg)
    common = dict(peak_scale=2.0, S=S, T=T, ref_rows=n, case="prefill")
    floor = roofline_row("", 1.0, bytes_min, flops, ceil, peak_scale=2.0)["floor_us"] / 1e6
    return [roofline_row(f"indexer_topk radix S={S} T={T}", t_old, bytes_min, flops, ceil, t_ref, impl="radix",
                         score_tflops=flops / max(t_old - t_old_topk, 1e-9) / 1e12, topk_share=t_old_topk / t_old,
                         **common),
            roofline_row(f"indexer_topk fused S={S} T={T}", t_new, bytes_min, flops, ceil, t_ref, impl="fused",
                         config=_cfg_str(cfg), score_tflops=flops / t_scores / 1e12, topk_share=t_select / t_new,
                         score_us=t_scores * 1e6, select_us=t_select * 1e6, speedup_vs_radix=t_old / t_new,
                         device_us=t_dev * 1e6, device_floor_frac=floor / t_dev, device_kernels_us=_us(kernels),
                         agreement=_agreement(case.select("radix"), case.select("fused", cfg)), **common)]


def bench_decode(dev, ceil, B: int, S: int, config: FusedConfig | None, topk: int = 2048) -> list[dict]:
    case = Case(dev, [S] * B, 1, topk)
    cfg = config or default_config(case.qsl)
    key_bytes = B * S * ROW
    flops = 2 * H * D * B * S
    t_ref = time_plain(lambda: indexer_topk_ref(case.q[:2], case.w[:2], case.cache, case.table, case.req[:2],
                                                case.pos[:2], topk, return_slots=False), dev, rep_ms=50) * B / 2
    t_old = time_plain(lambda: case.select("radix"), dev, rep_ms=200)
    t_new = time_plain(lambda: case.select("fused", cfg), dev, rep_ms=200)
    t_dev, kernels = device_time(lambda: case.select("fused", cfg), dev)
    t_scores, t_select = _fused_parts(dev, case, cfg)
    common = dict(B=B, S=S, case="decode")
    rows = []
    for impl, t in (("radix", t_old), ("fused", t_new)):
        extra = dict(config=_cfg_str(cfg), score_us=t_scores * 1e6, select_us=t_select * 1e6,
                     score_copy_frac=key_bytes / t_scores / (ceil["copy_tbps"] * 1e12), speedup_vs_radix=t_old / t_new,
                     device_us=t_dev * 1e6, device_key_copy_frac=key_bytes / t_dev / (ceil["copy_tbps"] * 1e12),
                     device_kernels_us=_us(kernels),
                     agreement=_agreement(case.select("radix"), case.select("fused", cfg))) if impl == "fused" else {}
        rows.append(roofline_row(f"indexer_topk {impl} decode B={B} S={S}", t, key_bytes, flops, ceil, t_ref,
                                 peak_scale=2.0, impl=impl, key_copy_frac=key_bytes / t / (ceil["copy_tbps"] * 1e12),
                                 **common, **extra))
    return rows


def _us(kernels: dict) -> dict:
    """{kernel: us per call}, long C++ names cut to their first 60 characters."""
    return {name[:60]: round(sec * 1e6, 1) for name, sec in kernels.items()}


def _cfg_str(cfg: FusedConfig) -> str:
    return f"block_t={cfg.block_t} block_n={cfg.block_n} warps={cfg.num_warps} stages={cfg.num_stages}"


SWEEP_PREFILL = [(4, 64, 4, 3), (4, 64, 8, 3), (8, 64, 8, 3), (4, 64, 4, 4), (2, 64, 4, 3), (4, 32, 4, 3)]
SWEEP_DECODE = [(1, 64, 4, 4), (1, 64, 4, 3), (1, 64, 4, 6), (1, 32, 4, 4), (1, 64, 8, 4)]


def sweep(dev, ceil, kind: str, best: dict, S: int = 131072, n: int | None = None, topk: int = 2048,
          tiles: list | None = None) -> list[dict]:
    """Score-kernel tiles (block_t, block_n, warps, stages) on the prefill (n = 2,048 rows) or the decode case
    (n = 64 requests); the fastest goes to best[kind]."""
    base, default_tiles = (PREFILL, SWEEP_PREFILL) if kind == "prefill" else (DECODE, SWEEP_DECODE)
    tiles = tiles or default_tiles
    if kind == "prefill":
        case = Case(dev, [S], n or 2048, topk)
    else:
        case = Case(dev, [S] * (n or 64), 1, topk)
    flops = 2 * H * D * int((case.pos + 1).sum())
    out, fastest = [], float("inf")
    for bt, bn, nw, ns in tiles:
        cfg = replace(base, block_t=bt, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            t = time_plain(functools.partial(case.select, "fused", cfg), dev, rep_ms=100)
        except Exception as e:  # noqa: BLE001 - a tile the device cannot run is reported, the sweep goes on
            out.append({"kernel": f"sweep indexer {kind} {_cfg_str(cfg)}", "error": repr(e)[:200]})
            continue
        out.append(roofline_row(f"sweep indexer {kind} {_cfg_str(cfg)}", t, case.S * ROW * len(case.seq_lens), flops,
                                ceil, peak_scale=2.0, config=_cfg_str(cfg)))
        if t < fastest:
            fastest, best[kind] = t, cfg
    return out


# (warps, scan); also timed on 2026-12-03 and not kept: several probes per search step (4, 8), a theta search
# stopping within k/8 of the k-th maximum, a 128-register cap (bench/data/kernels/indexer-select/NOTES.md)
SWEEP_SELECT = [(8, 4096), (8, 8192), (16, 4096), (4, 4096), (4, 2048)]


def sweep_select(dev, ceil, kind: str, best: dict, S: int, n: int, variants: list | None = None,
                 topk: int = 2048) -> list[dict]:
    """The threshold selection alone over the score kernel's real outputs, per (warps, scan): the
    prefill case (n rows at the end of an S-token context) or the decode case (n requests, one row each); the
    fastest select configuration goes into best[kind] (`warps` is `direct_warps` when S <= cap). Every
    variant must pick what the first picked."""
    base = best.get(kind) or (DECODE if kind == "decode" else PREFILL)
    case = Case(dev, [S] * n, 1, topk) if kind == "decode" else Case(dev, [S], n, topk)
    T = case.pos.shape[0]
    launch, scores, gmax = _score_outputs(dev, case, base, T)
    launch()
    out = torch.empty((T, topk), dtype=torch.int32, device=dev)
    rows, first, fastest = [], None, float("inf")
    for warps, scan in variants or SWEEP_SELECT:
        sel = replace(base.select, num_warps=warps, direct_warps=warps, scan=scan)
        name = f"sweep select {kind} S={S} warps={warps} scan={scan}"
        try:
            t = time_plain(lambda: topk_threshold_rows(scores, gmax, case.pos, topk, out, 0, sel), dev, rep_ms=100)
        except Exception as e:  # noqa: BLE001 - a variant the device cannot run is reported, the sweep goes on
            rows.append({"kernel": name, "error": repr(e)[:200]})
            continue
        picked = torch.sort(out, dim=1).values
        first = picked if first is None else first
        same = bool(torch.equal(picked, first))
        rows.append(roofline_row(name, t, T * S * 4, 0, ceil, warps=warps, scan=scan, same_picks=same, case=kind,
                                 S=S, rows=T))
        if same and t < fastest:
            fastest = t
            keep = dict(direct_warps=warps) if S <= sel.cap else dict(num_warps=warps, scan=scan)
            best[kind] = replace(base, select=replace(base.select, **keep))
    return rows


def run(dev, ceil, quick: bool, do_sweep: str | None, guard) -> tuple[list[dict], list[dict]]:
    """(rows, sweep rows) of the indexer section; `guard(rows, fn)` runs one part, keeping the rest on failure."""
    rows: list[dict] = []
    sweeps: list[dict] = []
    if quick:  # the script itself, through the interpreter on a CPU: numbers mean nothing
        if do_sweep:
            guard(sweeps, lambda: sweep(dev, ceil, "prefill", {}, 200, 4, 32, [(2, 32, 4, 1)]))
            variants = [(4, 4096), (8, 2048)]
            guard(sweeps, lambda: sweep_select(dev, ceil, "prefill", {}, 300, 8, variants, 32))
        guard(rows, lambda: bench_prefill(dev, ceil, 300, 8, 4, None, topk=32))
        guard(rows, lambda: bench_decode(dev, ceil, 3, 300, None, topk=32))
        return rows, sweeps
    best: dict = {"prefill": None, "decode": None, "prefill-short": None}
    if do_sweep == "all":  # score-kernel tiles
        for kind in ("prefill", "decode"):
            guard(sweeps, lambda: sweep(dev, ceil, kind, best))
    if do_sweep in ("all", "select"):
        best["prefill-short"] = best["prefill"]
        guard(sweeps, lambda: sweep_select(dev, ceil, "prefill", best, 131072, 2048))
        guard(sweeps, lambda: sweep_select(dev, ceil, "prefill-short", best, 8192, 2048))
        guard(sweeps, lambda: sweep_select(dev, ceil, "decode", best, 131072, 64))
    for S, ref_rows in ((8192, 256), (131072, 16), (1 << 20, 2)):
        cfg = best["prefill-short" if S <= 8192 else "prefill"]
        guard(rows, lambda: bench_prefill(dev, ceil, S, 2048, ref_rows, cfg))
    guard(rows, lambda: bench_decode(dev, ceil, 64, 131072, best["decode"]))
    return rows, sweeps

"""Human-readable rendering of a `pdserve plan` result (the dict `planner.cli.make_plan` returns)."""

from __future__ import annotations

from planner.capacity import GIB


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if abs(n) >= GIB / 10 else f"{n / (1 << 20):,.2f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return [("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths))).rstrip() for line in [header, *rows]]


def _kv_section(plan: dict) -> list[str]:
    m, kv, dep = plan["model"], plan["kv_bytes_per_token"], plan["deployment"]
    main_mla = m["mla_cache_layers"] - (1 if kv["mtp_mla"] else 0)
    main_idx = m["index_cache_layers"] - (1 if kv["mtp_indexer"] else 0)
    return [f"KV bytes per token ({dep['kv_cache_dtype']}, indexer {dep['indexer_precision']})",
            f"  MLA      {main_mla} layers x {m['mla_row_bytes']} B = {kv['mla']:,}",
            f"  indexer  {main_idx} layers x {m['index_row_bytes']} B = {kv['indexer']:,}",
            f"  MTP      MLA {kv['mtp_mla']} + indexer {kv['mtp_indexer']} = {kv['mtp_mla'] + kv['mtp_indexer']:,}",
            f"  total    {kv['total']:,} B per token"]


def _memory_section(plan: dict) -> list[str]:
    dep, mc = plan["deployment"], plan["max_context"]
    w, b = plan["weights_bytes_per_gpu"], plan["kv_budget_bytes_per_gpu"]
    lines = [f"Memory per GPU ({dep['hbm_gib']} GiB HBM x {dep['gpu_memory_utilization']}, reserve "
             f"{dep['reserve_gib']} GiB; {dep['weight_dtype']} weights, {_count(plan['num_params'])} params)"]
    lines += _table(["", "prefill", "decode"], [["weights", _gib(w["prefill"]), _gib(w["decode"])],
                                                 ["KV budget", _gib(b["prefill"]), _gib(b["decode"])]])
    by = plan.get("weights_bytes_by_dtype") or {}
    for role in ("prefill", "decode"):
        if by.get(role):
            lines.append(f"  {role} rank weights (engine model on meta): "
                         + ", ".join(f"{k} {_gib(v)}" for k, v in by[role].items()))
    host = plan["decode_host_bytes_per_rank"]
    lines.append(f"Host memory per decode rank: HiSparse pool {_gib(host['hisparse_pool'])} + KV offloading "
                 f"{_gib(host['kv_offloading'])} = {_gib(host['total'])} of {_gib(host['host_per_gpu'])}")
    limit = mc["max_position_embeddings"]
    note = lambda n: " (= max positions)" if n >= limit else ""
    lines.append(f"Largest context: prefill {mc['prefill']:,}{note(mc['prefill'])}; decode {mc['decode']:,}"
                 f"{note(mc['decode'])} (resident {mc['decode_resident']:,}, HiSparse {mc['decode_hisparse']:,} "
                 f"with a {dep['hisparse_pool_gib']} GiB host pool)")
    return lines


def _context_section(plan: dict) -> list[str]:
    dep = plan["deployment"]
    header = ["context", "KV/request", f"KV/GPU (DCP{dep['dcp']})", "prefill conc", "decode resident",
              "decode hybrid", "host-tier copies", "decode-tier copies"]
    rows = [[f"{r['context']:,}", _gib(r["kv_bytes"]), _gib(r["kv_bytes_per_gpu_dcp"]),
             str(r["prefill_concurrency"]), str(r["decode_concurrency_resident"]),
             str(r["decode_concurrency_hybrid"]), str(r["host_tier_contexts"]), str(r["decode_tier_contexts"])]
            for r in plan["contexts"]]
    return [f"Requests that fit (prefill: one engine of {dep['gpus']} GPUs; decode: one DP rank)",
            *_table(header, rows)]


def _roofline_section(plan: dict) -> list[str]:
    r, m = plan["roofline"], plan["model"]
    tags = {r["tp_heads"]: f"TP{r['n']}", r["pcp_heads"]: f"PCP{r['n']}"}
    rows = [[str(x["heads"]), f"{x['intensity']:.1f}", f"{x['attainable_fraction']:.1%}", x["bound"],
             tags.get(x["heads"], "")] for x in r["rows"]]
    return [f"Sparse MLA roofline (top-k {m['index_topk']}, {m['mla_row_bytes']} B rows): ridge "
            f"{r['ridge_flop_per_byte']:.1f} FLOP/B = {r['flops_per_s'] / 1e12:.0f} TFLOP/s / "
            f"{r['bytes_per_s'] / 1e12:.1f} TB/s",
            *_table(["heads/GPU", "FLOP/B", "of peak", "bound", ""], rows)]


def _flops_section(plan: dict) -> list[str]:
    p = plan["prefill_flops"]
    parts = ("indexer", "sparse_mla", "moe", "rest")
    rows = [[f"{r['context']:,}", f"{r['total']:.3g}"] + [f"{r['shares'][k]:.1%}" for k in parts] for r in p["rows"]]
    fmt = lambda n: "never (within 2^34 tokens)" if n is None else f"{n:,} token{'s' if n > 1 else ''}"
    return ["Prefill FLOPs of a fresh prompt (whole engine)",
            *_table(["context", "FLOPs", "indexer", "sparse MLA", "MoE", "rest"], rows),
            f"Indexer overtakes sparse MLA per GPU: at {fmt(p['crossover_tp'])} under TP={p['n']}, "
            f"at {fmt(p['crossover_pcp'])} under PCP={p['n']}"]


def format_plan(plan: dict) -> str:
    dep = plan["deployment"]
    head = [f"Model {plan['model']['name']}: prefill {dep['gpus']} GPUs (PCP{dep['pcp']} x TP{dep['tp']}, "
            f"DCP{dep['dcp']}, EP{dep['gpus']}); decode {dep['dp']} DP ranks (EP{dep['dp']}); MTP "
            f"{'on' if dep['with_mtp'] else 'off'}"]
    sections = [head, _kv_section(plan), _memory_section(plan), _context_section(plan), _roofline_section(plan),
                _flops_section(plan)]
    return "\n\n".join("\n".join(s) for s in sections)

"""Markdown tables of `bench.prefill.scaling` results (check and time runs)."""

from __future__ import annotations


def _name(r: dict) -> str:
    if r["pcp"] == 1:
        return "1 GPU (= a DP rank)"
    return f"PCP{r['pcp']}×DCP{r['dcp']}" + ("×EP" if r["ep"] else "")


def _ms(s: float) -> str:
    return f"{1e3 * s:,.0f} ms"


def check_table(r: dict) -> str:
    lines = [f"Multi-rank engine (PCP = DCP = EP = {r['pcp']}) against the one-rank engine:", "",
             "| model / mode | prompts (tokens) | max rel. logit error | min top-1 agreement | min cosine | "
             "greedy sequences equal (tokens agreeing) |", "|---|---|---|---|---|---|"]
    for name, c in r["cases"].items():
        p = c["prompts"]
        greedy = (f"{c['greedy_equal']}/{c['greedy_total']} ({', '.join(map(str, c['greedy_agree_tokens']))})"
                  if c["greedy_total"] else "–")
        lines.append(f"| {name} | {', '.join(p)} | {max(v['rel_err'] for v in p.values()):.2e} | "
                     f"{min(v['top1'] for v in p.values()):.4f} | {min(v['cos'] for v in p.values()):.6f} | {greedy} |")
    return "\n".join(lines)


def ttft_table(runs: list[dict]) -> str:
    base = next((r for r in runs if r["pcp"] == 1), None)
    multi = [r for r in runs if r["pcp"] > 1]
    head = ["prompt"] + [_name(r) for r in runs] + [f"speed-up {_name(r)}" for r in multi]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for L in runs[0]["ttft"]:
        cells = [f"{int(L):,}"] + [_ms(r["ttft"][L]["ttft_s"]) for r in runs]
        if base:
            t1 = base["ttft"][L]["ttft_s"]
            cells += [f"{t1 / r['ttft'][L]['ttft_s']:.2f}x (eff {t1 / r['ttft'][L]['ttft_s'] / r['pcp']:.2f})"
                      for r in multi]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Second turn (1,024 new tokens, the rest of the prompt cached):", "",
              "| prompt | " + " | ".join(_name(r) for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for L in runs[0]["ttft"]:
        lines.append(f"| {int(L):,} | " + " | ".join(
            f"{_ms(r['ttft'][L]['second_turn_s'])} (hit {r['ttft'][L]['second_turn_hit']:,})" for r in runs) + " |")
    return "\n".join(lines)


def context_table(runs: list[dict]) -> str:
    pcp_only = next((r for r in runs if r["pcp"] > 1 and r["dcp"] == 1), None)
    dcp = next((r for r in runs if r["dcp"] > 1), None)
    new = runs[0]["new"]
    lines = [f"A step of {new:,} new tokens after a cached context (prefetch = the per-layer context all-gather "
             "issued ahead and overlapped):", "",
             "| cached context | " + " | ".join(f"{_name(r)} prefetch on" for r in runs)
             + " | " + " | ".join(f"{_name(r)} prefetch off" for r in runs if r["pcp"] > 1)
             + (" | DCP extra cost (on) | overlap gain (DCP) |" if pcp_only and dcp else " |"),
             "|" + "---|" * (1 + len(runs) + sum(r["pcp"] > 1 for r in runs) + (2 if pcp_only and dcp else 0))]
    for P in runs[0]["context"]:
        cells = [f"{int(P):,}"] + [_ms(r["context"][P]["on"]["step_s"]) for r in runs]
        cells += [_ms(r["context"][P]["off"]["step_s"]) for r in runs if r["pcp"] > 1]
        if pcp_only and dcp:
            a, b = pcp_only["context"][P]["on"]["step_s"], dcp["context"][P]["on"]["step_s"]
            off = dcp["context"][P]["off"]["step_s"]
            cells += [f"{100 * (b - a) / a:+.1f}%", f"{100 * (off - b) / off:+.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comm_table(runs: list[dict]) -> str:
    rows = [(r, k) for r in runs for k in ("comm_bytes_per_layer", "comm_context") if k in r]
    if not rows:
        return ""
    meta = {"prompt", "cached", "attn_layers", "moe_layers", "total"}
    tags = sorted({t for r, k in rows for t in r[k]} - meta)
    lines = ["Bytes rank 0 receives per layer (MLA/indexer/context all-gathers: per attention layer; ep_*: per MoE "
             "layer; hidden: per forward):", "",
             "| config | request | " + " | ".join(tags) + " | total per request |", "|" + "---|" * (len(tags) + 3)]
    for r, k in rows:
        c = r[k]
        what = f"{c['prompt']:,} tokens" + (f" ({c['cached']:,} cached)" if "cached" in c else "")
        lines.append(f"| {_name(r)} | {what} | " + " | ".join(f"{c.get(t, 0) / 2**20:,.2f} MiB" for t in tags)
                     + f" | {c['total'] / 2**30:,.3f} GiB |")
    return "\n".join(lines)


def capacity_table(runs: list[dict]) -> str:
    lines = ["| config | KV blocks per rank | tokens that fit (KV) | engine build |", "|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {_name(r)} | {r['kv_blocks_per_rank']:,} | {r['kv_capacity_tokens']:,} "
                     f"| {r['build_s']:.0f} s |")
    return "\n".join(lines)


def report(results: list[dict]) -> str:
    out = [check_table(r) for r in results if r["kind"] == "check"]
    runs = sorted((r for r in results if r["kind"] == "time"), key=lambda r: (r["pcp"], r["dcp"]))
    if runs:
        out += [ttft_table(runs), context_table(runs), comm_table(runs), capacity_table(runs)]
    return "\n\n".join(x for x in out if x)

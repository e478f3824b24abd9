"""`python -m bench.kernels.structured_mask [--device cuda] [--out FILE]`: the per-step cost of the structured-output
token mask at batch 1 / 16 / 64 over a GLM-sized vocabulary (154,880 tokens), CPU or CUDA.

Each step of B constrained requests does what the runner does (engine/runner/structured.py):
    fill    every request's matcher writes its bitmask row (host, xgrammar; `build_bitmask`)
    apply   the bitmask goes to the logits' device and disallowed logits become -inf (`apply_bitmask`:
            xgrammar's kernel; `apply_ref`: our plain-torch fill, for comparison)
    accept  every matcher accepts the token drawn from its masked row
The vocabulary is synthetic but shaped like a code tokenizer's: the 256 single bytes, then the most
frequent words, space-prefixed words, indentation runs and punctuation runs of Python's standard library
sources, then their prefixes, up to the vocabulary size. Tokens are drawn at random from the masked rows,
so each request walks a random valid path (a finished matcher restarts).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import xgrammar as xgr

from engine.structured import StructuredOutputSpec as Spec
from engine.structured.grammar import GrammarBackend
from engine.structured.matcher import RequestGrammar, apply_backend, apply_bitmask, apply_bitmask_ref, build_bitmask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["file", "dir", "link"]}, "size": {"type": "number"}, "meta": {"type": "object"}},
    "required": ["name", "id", "tags", "kind"]}
GRAMMARS = {"json_schema": Spec.json_schema(SCHEMA), "json_object": Spec.json_object(),
            "regex": Spec.regex(r"(def [a-z_]+\([a-z, ]*\):\n(    [^\n]+\n)+)+")}


def synthetic_vocab(size: int) -> list[str]:
    counts: collections.Counter = collections.Counter()
    pieces = re.compile(r" ?[A-Za-z_]+| ?[0-9]{1,3}|\n[ ]+| {2,}|[^\sA-Za-z0-9_]{1,3}")
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        counts.update(pieces.findall(f.read_text(errors="ignore")))
    vocab = ["<|endoftext|>"] + [chr(b) if 32 <= b < 127 else f"<0x{b:02X}>" for b in range(256)]
    seen = set(vocab)
    for word, _ in counts.most_common():
        if len(vocab) >= size:
            break
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    for word in list(vocab[257:]):
        for k in range(2, len(word)):
            if len(vocab) >= size:
                break
            if word[:k] not in seen:
                seen.add(word[:k])
                vocab.append(word[:k])
    n = len(vocab)
    vocab += [f"<|pad_{i}|>" for i in range(size - n)]  # special tokens: never allowed by a grammar
    return vocab[:size]


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_case(backend: GrammarBackend, spec: Spec, batch: int, steps: int, dev: torch.device, seed: int) -> dict:
    V = backend.vocab_size
    grammars = [RequestGrammar(backend, spec, [1]) for _ in range(batch)]
    gen = torch.Generator(device=dev).manual_seed(seed)
    fill, apply, ref, accept = [], [], [], []
    for step in range(steps + 3):
        logits = torch.randn(batch, V, device=dev, generator=gen)
        t0 = time.perf_counter()
        bitmask, rows, _ = build_bitmask([(i, g, []) for i, g in enumerate(grammars)], batch, V)
        t1 = time.perf_counter()
        spare = logits.clone()
        _sync(dev)
        t2 = time.perf_counter()
        apply_bitmask(logits, bitmask, rows)
        _sync(dev)
        t3 = time.perf_counter()
        apply_bitmask_ref(spare, bitmask, rows)
        _sync(dev)
        t4 = time.perf_counter()
        gumbel = -torch.log(-torch.log(torch.rand(logits.shape, device=dev, generator=gen).clamp_min(1e-20)))
        tokens = torch.argmax(logits + gumbel, dim=-1).tolist()  # a random token among the allowed ones
        t5 = time.perf_counter()
        for i, (g, t) in enumerate(zip(grammars, tokens)):
            if not g.advance(t) or g.is_terminated:
                grammars[i] = RequestGrammar(backend, spec, [1])
        t6 = time.perf_counter()
        if step >= 3:  # warm-up steps left out
            fill.append(t1 - t0)
            apply.append(t3 - t2)
            ref.append(t4 - t3)
            accept.append(t6 - t5)
    total = [a + b + c for a, b, c in zip(fill, apply, accept)]
    return {"batch": batch, "fill_ms": _ms(fill), "apply_ms": _ms(apply), "apply_ref_ms": _ms(ref),
            "accept_ms": _ms(accept), "step_ms": _ms(total)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=154_880)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--grammar", default=",".join(GRAMMARS), help=f"of {', '.join(GRAMMARS)}")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    t = time.perf_counter()
    info = xgr.TokenizerInfo(synthetic_vocab(a.vocab), vocab_type=xgr.VocabType.RAW, vocab_size=a.vocab,
                             stop_token_ids=[0])
    backend = GrammarBackend(info)
    setup_s = time.perf_counter() - t
    results = []
    for name in a.grammar.split(","):
        t = time.perf_counter()
        backend.compile(GRAMMARS[name])
        compile_ms = round((time.perf_counter() - t) * 1e3, 1)
        for b in (int(x) for x in a.batch.split(",")):
            r = {"grammar": name, "compile_ms": compile_ms, **run_case(backend, GRAMMARS[name], b, a.steps, dev, b)}
            results.append(r)
            print(json.dumps(r), flush=True)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "vocab": a.vocab,
            "tokenizer_setup_s": round(setup_s, 2), "steps": a.steps, "apply_backend": apply_backend(dev)}
    print(json.dumps(meta))
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()

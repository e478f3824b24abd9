"""The start-up warm-up (`--warmup`): step once through the batch shapes a server meets, before it serves.

A compiled Triton kernel is specialised on its launch arguments (kernels/jit_variants.py): each constexpr value
(block sizes chosen from a row count's power of two, for one) and each integer's class (1, a multiple of 16,
neither). Every new combination compiles at its first launch, 0.5-2 s inside an engine step. A cold GPU service
met 94 such variants in its first 2 minutes of traffic, with prefill steps of 566 ms where a warm one takes 11
(bench/data/simulate/NOTES.md). The warm-up meets them first, with requests of its own:

- prefills of every token count class up to one step's budget: in each power-of-two bucket up to
  `max_num_batched_tokens`, the smallest and largest count that is 1, a multiple of 16, or neither;
- the same prompts extended by a few tokens: the cached-prefix path (attention over cached context);
- decodes of every batch-size class up to `max_num_seqs` (the same classes), a few steps each,
  with the engine's MTP drafts when it has them;
- decodes over a context longer than the indexer's top-k (batch-size classes up to 16): the sparse selection's
  scores and top-k at decode shapes, which short contexts never reach.

Then it leaves nothing behind that a client could see: every request finished and dropped, every KV block free,
the prefix cache empty (its hashes forgotten, and the events of storing and dropping them discarded, so no
router hears of them). The engine's own step and hit counters keep the warm-up's figures; the services count
from where the warm-up ended (services/engine_host.py takes its baseline after it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

FIRST_ID = 16  # prompt ids from here (below: the small checkpoints' special tokens)
DECODE_TOKENS = 4  # output tokens per warm-up decode (a few steps at each batch size)
LONG_BATCH = 16  # the largest batch of long-context decodes (contexts past the indexer's top-k)
PROMPT_EXTEND = 3  # tokens a cached-prefix prompt adds to its first turn


@dataclass
class WarmupReport:
    prefill_lengths: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)
    long_decode_batches: list[int] = field(default_factory=list)
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0


def size_classes(limit: int) -> list[int]:
    """Sizes up to `limit` that meet each integer class (1, a multiple of 16, neither) in each power-of-two bucket
    (2^(b-1), 2^b]: the smallest and the largest size of every (class, bucket) pair."""
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for n in range(1, limit + 1):
        key = ("1" if n == 1 else "D" if n % 16 == 0 else "", (n - 1).bit_length())
        first.setdefault(key, n)
        last[key] = n
    return sorted(set(first.values()) | set(last.values()))


def warmup_shapes(cfg, max_tokens: int | None = None, max_batch: int | None = None) -> tuple[list[int], list[int]]:
    """(prefill token counts, decode batch sizes) the warm-up runs for an engine config (capped by the two limits
    when given)."""
    sc = cfg.scheduler
    longest = min(sc.max_num_batched_tokens, sc.max_model_len - DECODE_TOKENS - PROMPT_EXTEND - 1,
                  max_tokens or sc.max_num_batched_tokens)
    return size_classes(max(longest, 1)), size_classes(min(sc.max_num_seqs, max_batch or sc.max_num_seqs))


def _ids(n: int, salt: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(0x5EED + salt)
    return torch.randint(min(FIRST_ID, vocab - 1), vocab, (n,), generator=g).tolist()


def _pools(core):
    return getattr(core, "kvs", None) or [core.kv]


def _fits(core, n_tokens: int, n_requests: int = 1) -> bool:
    kv = _pools(core)[0]
    return n_requests * kv.blocks_needed(n_tokens + DECODE_TOKENS + 1) <= kv.num_blocks


def _run(core, reqs: list[Request], report: WarmupReport) -> None:
    for r in reqs:
        core.add_request(r)
    report.requests += len(reqs)
    while core.has_unfinished() or core.has_finished_to_drop():
        core.step()
        report.steps += 1


def warm_up(core, max_tokens: int | None = None, max_batch: int | None = None,
            long_context: bool = True) -> WarmupReport:
    """Run the warm-up on an idle engine core (EngineCore or a multi-rank one) and clean up after it; `max_tokens`
    and `max_batch` cap the shapes, `long_context` False leaves out the decodes past the top-k (tests)."""
    if core.has_unfinished():
        raise RuntimeError("the warm-up runs before an engine serves: this one has requests")
    cfg = core.cfg
    vocab = cfg.model.vocab_size
    lengths, batches = warmup_shapes(cfg, max_tokens, max_batch)
    report = WarmupReport()
    t0 = time.perf_counter()
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for i, n in enumerate(lengths):  # each prefill class alone, then its cached-prefix turn
        if not _fits(core, n + PROMPT_EXTEND):
            continue
        prompt = _ids(n, i, vocab)
        _run(core, [Request(f"warmup-p{n}", prompt, one)], report)
        _run(core, [Request(f"warmup-p{n}-c", prompt + _ids(PROMPT_EXTEND, 10_000 + i, vocab), one)], report)
        report.prefill_lengths.append(n)
    few = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0.0)
    for b in batches:  # each decode batch class: b requests prefilled together, then decoding together
        prompt_len = 16 + (b % 17)
        if not _fits(core, prompt_len, b):
            continue
        _run(core, [Request(f"warmup-d{b}-{j}", _ids(prompt_len, 100_000 + 1_000 * b + j, vocab), few)
                    for j in range(b)], report)
        report.decode_batches.append(b)
    topk = getattr(cfg.model, "index_topk", 0) or 0
    long_len = topk + 33  # past the top-k: the indexer scores and selects
    if long_context and topk and long_len + DECODE_TOKENS < cfg.scheduler.max_model_len:
        for b in size_classes(min(cfg.scheduler.max_num_seqs, max_batch or LONG_BATCH, LONG_BATCH)):
            if not _fits(core, long_len, b):
                break
            _run(core, [Request(f"warmup-l{b}-{j}", _ids(long_len, 200_000 + 1_000 * b + j, vocab), few)
                        for j in range(b)], report)
            report.long_decode_batches.append(b)
    _forget(core)
    report.seconds = time.perf_counter() - t0
    log.info("warm-up: %d prefill lengths (1-%d tokens), %d decode batch sizes (1-%d), %d long-context ones: %d "
             "requests, %d steps in %.1f s", len(report.prefill_lengths), max(report.prefill_lengths, default=0),
             len(report.decode_batches), max(report.decode_batches, default=0), len(report.long_decode_batches),
             report.requests, report.steps, report.seconds)
    return report


def _forget(core) -> None:
    """Every block free, the prefix cache empty, and the KV events of the warm-up discarded."""
    for kv in _pools(core):
        if kv.num_free_blocks != kv.num_blocks or not kv.pool.reset_prefix_cache():
            raise RuntimeError(f"the warm-up left {kv.num_blocks - kv.num_free_blocks} KV blocks in use")
    core.drain_rank_kv_events()

"""A calibration profile: what one step of each engine layout costs, what a KV transfer costs, what the
services add per request — measured (`pdserve bench calibrate`) or taken from a named source, never fitted to a
figure the simulator is meant to predict.

    {"version": 1, "hardware": "...", "commit": "...", "date": "...", "model": "...",
     "engines": {"prefill/pcp1-dcp1": {"step_s": ..., "token_s": ..., "token_ctx_s": ..., "request_s": ...,
                                       "chunk_ctx_s": ..., "source": "..."},
                 "decode/dp1-hisparse": {...}},
     "transfer": {"latency_s": ..., "gbs": ..., "by_streams": [[streams, seconds], ...], "source": "..."},
                                       (by_streams optional: the handoff's latency while other requests stream;
                                        busy_s optional: a handoff while the prefill is kept busy)
     "kvstore": {"latency_s": ..., "gbs": ..., "source": "..."},      (where the topology has a kvstore)
     "request_overhead_s": {"value": ..., "by_streams": [[streams, seconds], ...], "source": "..."},
                                       (by_streams optional: the overhead while other requests stream)
     "shared_device": {"prefill": ..., "decode": ..., "source": "..."},   (optional: engines sharing a device)
     "prefill_served": {"alone_s": ..., "by_streams": [[0, seconds], [streams, seconds], ...], "source": "...",
                        "busy_s": ..., "busy_alone_s": ..., "busy_step_buckets": [[le, count], ...]}}
                                       (busy_* optional: the busy window's mean step, the same turns' alone, and
                                        its step histogram)
                                       (optional: a prefill step as the running services take it)

One engine step of a scheduled batch costs

    step_s + token_s · N + token_ctx_s · Σ n_i · (start_i + n_i / 2) + request_s · B

with N the tokens computed (all rows, drafts included), B the requests, and the middle sum each chunk's rows
times the mean context they attend over (the attention and indexer work that grows with the context). An entry
may add

    + chunk_ctx_s · Σ (start_i + n_i)

for the context each chunk reads once whatever its rows (the cached KV pages dequantised or streamed per chunk: on
a short turn after a long cached prefix this, not the rows, is most of the attention's cost),

    + draft_pass_s · max_i d_i

for the MTP draft passes the step runs after its target pass (d_i: the drafts chunk i proposes for the next step,
the scheduler's `max_drafts`; one forward a draft, over the requests still drafting, so the step runs the
largest d_i of them): a request's last steps propose fewer drafts or none, and a step's draft work follows the
drafts it proposes, not the tokens it verifies; and a term for
sparse attention, whose work per row stops growing once the context passes the
indexer's top-k (`index_topk`, K):

    + token_sel_s · Σ_rows min(context of the row, K)

so that the indexer (every key scored: linear in the context) and sparse MLA (at most K keys attended) can
each keep their own shape. One rank of a DP x EP group may add another, for the routed experts' work, which expert
parallelism spreads over the group's GPUs whatever rank the rows came from:
    + group_token_s · (tokens computed by the whole group in this step) / (its ranks)
(alone, or outside a group, the engine's own N). A decode engine's layout key is its DP size, with `-hisparse` where
its requests are admitted by HiSparse (other step costs: the plan and miss copies); a prefill engine's its PCP and
DCP sizes, or its DP size for one rank of a DP x EP prefill group ("prefill/dp8": simulated only, see
bench/simulate/system.py).

`shared_device` is for topologies that place a prefill and a decode engine on one device (one GPU, or one
machine's CPU cores): each role's slowdown (>= 1) while the other engine is in a step too, measured by
`pdserve bench calibrate --through-services` (bench/simulate/engines.py, SharedDevice). Without it, engines
sharing a device are costed as if each had it alone, and the result says so.

`prefill_served` is a lone prompt's prefill step as the running services take it (the prefill engine's own step
counters over one probe request, `pdserve bench calibrate --through-services`), idle and while other requests
stream their tokens, beside the same prompt's step on the engine alone (`alone_s`). On a GPU a host-bound prefill
step takes longer in the service than alone (H100, measured the same day: tiny-code 15.9 ms idle and 14.6-19.9 ms
under 4-16 streams against 13.9 ms alone; GLM-5.3 widths 18.4 and 23.6-24.1 against 12.0 ms), and the engine-alone
fit misses it. Where the calibration also kept the prefill busy through the services (its `shared_device`
window, the traces' turns), the entry holds that window's mean step (`busy_s`) beside the same turns' median step on
the engine alone (`busy_alone_s`): each simulated prefill step then costs its fit plus `busy_s - busy_alone_s`
(the services' cost of a step under load, whatever the streams; measured runs' steps are as long as the busy
window's, longer than a lone probe's: bench/data/simulate/NOTES.md, fourteenth session). Without `busy_s` (or with
`pdserve simulate --served-prefill-by-streams`) it costs its fit plus the lone probe's difference for the streams
live at its start (joined linearly between the points, flat past the last, never below 0). Both include the
decode's share of the device, so the prefill's `shared_device` slowdown is not applied on top.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from bench.serving.engine_counters import histogram_quantile

TERMS = ("step_s", "token_s", "token_ctx_s", "request_s")
# the terms a calibrated entry's `measured` rows give features for, in order (bench/simulate/calibrate.py)
MEASURED_TERMS = (*TERMS, "chunk_ctx_s", "draft_pass_s")
BUSY_SPREAD_DRAWS = 40  # equally likely quantiles of the busy window's step histogram (served_prefill_spread)


class ProfileError(ValueError):
    """A profile that cannot drive the simulation asked of it: says which entry is missing or wrong."""


def selected(start: int, n: int, topk: int) -> int:
    """Σ_{i=1..n} min(start + i, topk): the keys sparse attention reads for n rows after `start` cached."""
    full = max(0, min(n, start + n - topk))  # rows whose context reaches topk
    part = n - full  # rows at contexts start+1 .. start+part, all below topk
    return full * topk + part * start + part * (part + 1) // 2


def draft_passes(chunks) -> int:
    """The MTP draft forwards a step runs after its target pass: the most drafts any chunk proposes (`max_drafts`;
    0 for a chunk that has none, mid-prompt or without MTP)."""
    return max((getattr(c, "max_drafts", 0) for c in chunks), default=0)


@dataclass(frozen=True)
class StepCost:
    step_s: float
    token_s: float
    token_ctx_s: float
    request_s: float
    source: str = ""
    token_sel_s: float = 0.0
    index_topk: int = 0
    group_token_s: float = 0.0
    chunk_ctx_s: float = 0.0
    draft_pass_s: float = 0.0

    def __call__(self, chunks, group_tokens_per_rank: float | None = None) -> float:
        """Seconds of one step over `chunks` (ScheduledChunk: start, token_ids); `group_tokens_per_rank`: the
        tokens its DP group computes in the step over the group's ranks (None: the engine's own)."""
        n = sum(len(c.token_ids) for c in chunks)
        ctx = sum(len(c.token_ids) * (c.start + len(c.token_ids) / 2) for c in chunks)
        out = self.step_s + self.token_s * n + self.token_ctx_s * ctx + self.request_s * len(chunks)
        if self.group_token_s:
            out += self.group_token_s * (n if group_tokens_per_rank is None else group_tokens_per_rank)
        if self.chunk_ctx_s:
            out += self.chunk_ctx_s * sum(c.start + len(c.token_ids) for c in chunks)
        if self.draft_pass_s:
            out += self.draft_pass_s * draft_passes(chunks)
        if self.token_sel_s:
            out += self.token_sel_s * sum(selected(c.start, len(c.token_ids), self.index_topk) for c in chunks)
        return out


class DispersedCost:
    """A step cost whose every step is drawn around it: the cost times one of `ratios` (Profile.dispersion), from
    a seeded generator (the same seed, the same steps). A DP group's lock-step pass keeps the plain cost (its
    ranks' draws would only add their maximum)."""

    def __init__(self, cost: StepCost, ratios: list[float], seed: int):
        self.base, self.ratios, self.rng = cost, ratios, random.Random(seed)

    def __call__(self, chunks, group_tokens_per_rank: float | None = None) -> float:
        if group_tokens_per_rank is not None:
            return self.base(chunks, group_tokens_per_rank)
        return self.base(chunks) * (self.rng.choice(self.ratios) if chunks else 1.0)


@dataclass(frozen=True)
class Profile:
    raw: dict
    path: str = ""

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"profile {path}: cannot read it ({e})") from None
        if not isinstance(raw, dict) or raw.get("version") != 1 or not isinstance(raw.get("engines"), dict):
            raise ProfileError(f"profile {path}: not a version-1 profile (needs \"version\": 1 and \"engines\")")
        return cls(raw, str(path))

    def engine(self, key: str) -> StepCost:
        """The step cost of an engine layout ("prefill/pcp8-dcp8", "decode/dp8")."""
        entry = self.raw["engines"].get(key)
        if entry is None:
            have = ", ".join(sorted(self.raw["engines"])) or "none"
            raise ProfileError(f"profile {self.path} has no step costs for {key} (the topology needs them); "
                               f"it has: {have}")
        missing = [t for t in TERMS if not isinstance(entry.get(t), (int, float)) or entry[t] < 0]
        if missing:
            raise ProfileError(f"profile {self.path}: {key} lacks non-negative {', '.join(missing)}")
        sel, topk = entry.get("token_sel_s", 0.0), entry.get("index_topk", 0)
        if not isinstance(sel, (int, float)) or sel < 0 or (sel and (not isinstance(topk, int) or topk < 1)):
            raise ProfileError(f"profile {self.path}: {key}: token_sel_s must be >= 0, and with it index_topk a "
                               f"positive integer (got {sel!r}, {topk!r})")
        extra = {t: entry.get(t, 0.0) for t in ("group_token_s", *MEASURED_TERMS[len(TERMS):])}
        for t, v in extra.items():
            if not isinstance(v, (int, float)) or v < 0:
                raise ProfileError(f"profile {self.path}: {key}: {t} must be >= 0, got {v!r}")
        return StepCost(*(float(entry[t]) for t in TERMS), source=str(entry.get("source", "")),
                        token_sel_s=float(sel), index_topk=int(topk or 0),
                        **{t: float(v) for t, v in extra.items()})

    def dispersion(self, key: str) -> list[float] | None:
        """How much an engine layout's steps of one shape vary: each measured step's seconds over its fitted cost
        (the entry's `measured` rows: the calibration's features, then seconds), scaled to mean 1 so that the
        draws add spread, not time; None where the entry kept no steps."""
        entry = self.raw["engines"].get(key) or {}
        rows = entry.get("measured")
        if not rows:
            return None
        coef = [float(entry.get(t, 0.0)) for t in MEASURED_TERMS]
        ratios = []
        for row in rows:
            if isinstance(row, list) and len(row) == len(coef):  # written before the draft term: no drafts column
                row = [*row[:-1], 0.0, row[-1]]
            if not (isinstance(row, list) and len(row) == len(coef) + 1
                    and all(isinstance(v, (int, float)) for v in row)):
                raise ProfileError(f"profile {self.path}: {key}.measured rows must be [{', '.join(MEASURED_TERMS)} "
                                   f"features..., seconds] (got {row!r})")
            fitted = sum(c * f for c, f in zip(coef, row))
            if fitted > 0 and row[-1] > 0:
                ratios.append(row[-1] / fitted)
        if not ratios:
            return None
        mean = sum(ratios) / len(ratios)
        return [r / mean for r in ratios]

    def transfer_s(self, nbytes: float, streams: float = 0, prefill_busy: bool = False) -> float:
        """A KV handoff from a prefill to a decode while `streams` other requests stream their tokens: the entry's
        latency (its `by_streams` points joined linearly from (0, latency_s), flat past the last, where it has
        them) plus the bytes at its bandwidth. `prefill_busy`: the prefill that computed it has more work, and the
        entry measured a handoff then (`busy_s`, see `busy_handoff_s`): that latency instead."""
        t = self._entry("transfer", ("latency_s", "gbs"))
        busy = self.busy_handoff_s if prefill_busy else None
        latency = busy if busy is not None else \
            _linear([(0.0, float(t["latency_s"])), *self._stream_points(t, "transfer")], streams)
        return latency + nbytes / (t["gbs"] * 1e9)

    @property
    def busy_handoff_s(self) -> float | None:
        """The handoff's latency while its prefill is kept busy (`transfer.busy_s`, written by `bench calibrate
        --through-services`), None where the profile did not measure it."""
        busy = self._entry("transfer", ("latency_s", "gbs")).get("busy_s")
        if busy is None:
            return None
        if not isinstance(busy, (int, float)) or isinstance(busy, bool) or busy <= 0:
            raise ProfileError(f"profile {self.path}: transfer.busy_s must be seconds > 0 (got {busy!r})")
        return float(busy)

    def kvstore_s(self, nbytes: float) -> float:
        """A load from or an offload to a kvstore (required where the topology has one)."""
        t = self._entry("kvstore", ("latency_s", "gbs"))
        return t["latency_s"] + nbytes / (t["gbs"] * 1e9)

    @property
    def request_overhead_s(self) -> float:
        """The services' time per request on an idle system."""
        return self._entry("request_overhead_s", ("value",))["value"]

    def request_overhead(self, streams: int) -> float:
        """The services' time per request while `streams` other requests stream their tokens: the entry's
        `by_streams` points ([streams, seconds], measured) joined linearly from (0, value), flat past the last;
        the idle value where the entry has none."""
        entry = self._entry("request_overhead_s", ("value",))
        return _linear([(0.0, float(entry["value"])), *self._stream_points(entry, "request_overhead_s")], streams)

    def _stream_points(self, entry: dict, name: str) -> list[tuple[float, float]]:
        """An entry's `by_streams` points ([streams > 0, seconds >= 0], streams increasing); none where absent."""
        raw = entry.get("by_streams", [])
        ok = isinstance(raw, list) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p)
            and p[0] > 0 and p[1] >= 0 for p in raw)
        xs = [p[0] for p in raw] if ok else []
        if not ok or xs != sorted(set(xs)):
            raise ProfileError(f"profile {self.path}: {name}.by_streams must be [streams > 0, seconds >= 0] pairs "
                               f"with the streams increasing (got {raw!r})")
        return [(float(x), float(y)) for x, y in raw]

    def served_prefill_spread(self, by_streams: bool = False) -> list[float] | None:
        """How much a prefill step in the services varies, as ratios of mean 1. Where the busy window is the served
        step (served_prefill_extra) and kept its step histogram (`busy_step_buckets`): BUSY_SPREAD_DRAWS equally
        likely quantiles of it (linear within a bucket). Else each lone probe's step (`probe_steps_s`) over the
        median of its stream count's probes. None where the entry kept neither."""
        entry = self.raw.get("prefill_served") or {}
        if not by_streams and self.served_prefill_busy is not None and isinstance(entry, dict) \
                and "busy_step_buckets" in entry:
            return self._busy_spread(entry["busy_step_buckets"])
        sets = entry.get("probe_steps_s") if isinstance(entry, dict) else None
        if not sets:
            return None
        if not isinstance(sets, dict) or not all(
                isinstance(v, list) and v and all(isinstance(x, (int, float)) and x > 0 for x in v)
                for v in sets.values()):
            raise ProfileError(f"profile {self.path}: prefill_served.probe_steps_s must map stream counts to lists "
                               f"of positive seconds (got {sets!r})")
        ratios = []
        for steps in sets.values():
            mid = sorted(steps)[len(steps) // 2]
            ratios += [x / mid for x in steps]
        mean = sum(ratios) / len(ratios)
        return [r / mean for r in ratios]

    def _busy_spread(self, buckets) -> list[float]:
        """`busy_step_buckets` checked, then BUSY_SPREAD_DRAWS of its quantiles over their mean."""
        ok = isinstance(buckets, list) and buckets and all(
            isinstance(b, list) and len(b) == 2 and (b[0] is None or isinstance(b[0], (int, float)) and b[0] > 0)
            and isinstance(b[1], (int, float)) and b[1] >= 0 for b in buckets)
        bounds = [float("inf") if b[0] is None else float(b[0]) for b in buckets] if ok else []
        counts = [float(b[1]) for b in buckets] if ok else []
        if not ok or bounds != sorted(set(bounds)) or counts != sorted(counts) or counts[-1] <= 0:
            raise ProfileError(f"profile {self.path}: prefill_served.busy_step_buckets must be [upper bound (null: "
                               f"+Inf), cumulative count] pairs, bounds rising, counts not falling, some steps "
                               f"(got {buckets!r})")
        hist = list(zip(bounds, counts))
        draws = [histogram_quantile((i + 0.5) / BUSY_SPREAD_DRAWS, hist) for i in range(BUSY_SPREAD_DRAWS)]
        mean = sum(draws) / len(draws)
        return [d / mean for d in draws]

    def served_prefill_extra(self, streams: float, ratio: float = 1.0, by_streams: bool = False) -> float:
        """Seconds a prefill step takes in the running services beyond its engine-alone cost (`prefill_served`):
        the busy window's (`busy_s` less `busy_alone_s`) where the entry has it and `by_streams` is False, else the
        lone probe's while `streams` requests stream their tokens; 0 where the profile has no such entry. `ratio`:
        the served step drawn at that multiple of its median (served_prefill_spread)."""
        if self._served_points is None:
            return 0.0
        alone, points = self._served_points
        busy = self.served_prefill_busy
        if busy is not None and not by_streams:
            return max(busy[0] * ratio - busy[1], 0.0)
        return max(_linear(points, streams) * ratio - alone, 0.0)

    @cached_property
    def served_prefill_busy(self) -> tuple[float, float] | None:
        """(`busy_s`, `busy_alone_s`) of `prefill_served`, None where the entry has no busy window."""
        entry = self.raw.get("prefill_served")
        if not isinstance(entry, dict) or "busy_s" not in entry and "busy_alone_s" not in entry:
            return None
        busy, alone = entry.get("busy_s"), entry.get("busy_alone_s")
        if not all(isinstance(v, (int, float)) and v > 0 for v in (busy, alone)):
            raise ProfileError(f"profile {self.path}: prefill_served needs busy_s > 0 and busy_alone_s > 0 together "
                               f"(got busy_s {busy!r}, busy_alone_s {alone!r})")
        return float(busy), float(alone)

    @cached_property
    def _served_points(self) -> tuple[float, list[tuple[float, float]]] | None:
        """`prefill_served` read and checked once: (alone_s, its [streams, seconds] points)."""
        entry = self.raw.get("prefill_served")
        if entry is None:
            return None
        alone, raw = (entry.get("alone_s"), entry.get("by_streams")) if isinstance(entry, dict) else (None, None)
        ok = isinstance(alone, (int, float)) and alone >= 0 and isinstance(raw, list) and raw and all(
            isinstance(q, (list, tuple)) and len(q) == 2 and all(isinstance(v, (int, float)) for v in q)
            and q[0] >= 0 and q[1] >= 0 for q in raw)
        xs = [q[0] for q in raw] if ok else []
        if not ok or xs[0] != 0 or xs != sorted(set(xs)):
            raise ProfileError(f"profile {self.path}: prefill_served needs alone_s >= 0 and by_streams [streams, "
                               f"seconds >= 0] pairs from 0 streams, increasing (got {entry!r})")
        return float(alone), [(float(x), float(y)) for x, y in raw]

    @property
    def has_served_prefill(self) -> bool:
        return self.raw.get("prefill_served") is not None

    @property
    def shared_device(self) -> dict[str, float] | None:
        """{role: slowdown} of engines sharing a device, None when the profile has no such entry."""
        entry = self.raw.get("shared_device")
        if entry is None:
            return None
        if not isinstance(entry, dict) or any(not isinstance(entry.get(r), (int, float)) or entry[r] < 1
                                              for r in ("prefill", "decode")):
            raise ProfileError(f"profile {self.path}: shared_device needs a slowdown >= 1 for prefill and decode "
                               f"(got {entry!r})")
        return {r: float(entry[r]) for r in ("prefill", "decode")}

    @property
    def hbm_gib(self) -> float | None:
        return self.raw.get("hbm_gib")

    def _entry(self, name: str, fields: tuple[str, ...]) -> dict:
        entry = self.raw.get(name)
        if not isinstance(entry, dict) or any(not isinstance(entry.get(f), (int, float)) for f in fields):
            raise ProfileError(f"profile {self.path} has no {name} entry with {', '.join(fields)}")
        if name in ("transfer", "kvstore") and entry["gbs"] <= 0:
            raise ProfileError(f"profile {self.path}: {name}.gbs must be > 0")
        return entry


def _linear(points: list[tuple[float, float]], x: float) -> float:
    """y at x on (x, y) points (x increasing) joined linearly, flat before the first and past the last."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def prefill_key(pcp: int, dcp: int, dp: int = 1) -> str:
    """A prefill engine's layout: its PCP and DCP sizes, or (dp > 1) one rank of a DP x EP prefill group."""
    return f"prefill/dp{dp}" if dp > 1 else f"prefill/pcp{pcp}-dcp{dcp}"


def decode_key(dp: int, hisparse: bool = False) -> str:
    return f"decode/dp{dp}" + ("-hisparse" if hisparse else "")

"""deploy/grafana: each dashboard imports into any Grafana (its datasource is the `${DS_PROMETHEUS}` input,
never a uid of ours), and every metric its PromQL reads is one a service exports: the names of
services/rpc/metrics.py as they appear on /metrics (`pdserve:` with the `_total` / `_bucket` / `_sum` / `_count`
/ `_info` suffixes Prometheus adds, and the `vllm:` names), taken from the services' own registries. Renaming
a metric fails here instead of leaving a blank panel. test_autoscaling.py checks its queries the same way."""

from __future__ import annotations

import copy
import json
import re
from functools import cache

import pytest

from services.rpc.metrics import ROLES, ServiceMetrics
from tests.helpers import ROOT

DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# the series Prometheus stores for one family of prometheus_client's, by the family's type
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
FUNCTIONS = {"sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "group", "rate", "irate",
             "increase", "delta", "deriv", "histogram_quantile", "clamp_min", "clamp_max", "abs", "vector",
             "scalar", "label_replace", "absent", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_WORD = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_ROLE = re.compile(r'\brole\s*=(~?)\s*"([^"]*)"')


@cache
def exported() -> dict[str, frozenset[str]]:
    """Every series name a service puts on /metrics -> the roles that put it there."""
    roles: dict[str, set[str]] = {}
    for role in ROLES:
        m = ServiceMetrics(role, f"{role}-0")
        m.describe_model("model", {"block_size": "64"})  # the vllm: names too
        for family in m.registry.collect():
            for suffix in SUFFIXES[family.type]:
                roles.setdefault(family.name + suffix, set()).add(role)
    return {name: frozenset(r) for name, r in roles.items()}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, grouping
    labels, keywords and function names are taken out. A function it does not know is an error (add it to
    FUNCTIONS), so a misspelt one is not taken for a metric."""
    e = _GROUPING.sub("", _RANGE.sub("", _MATCHERS.sub("", _STRING.sub('""', expr))))
    names = set()
    for word, call in _WORD.findall(e):
        if word.lower() in KEYWORDS:
            continue
        if call and word not in FUNCTIONS:
            raise ValueError(f"unknown PromQL function {word!r} in {expr}")
        if not call:
            names.add(word)
    return names


def roles_named(expr: str) -> set[str]:
    """The roles an expression restricts itself to: role="x", or role=~"x|y"."""
    out = set()
    for regex, value in _ROLE.findall(expr):
        out |= set(value.split("|")) if regex else {value}
    return out


def problems(expr: str) -> list[str]:
    """What is wrong with one expression's metrics: none read, a name no service exports, or a name the role
    it selects does not export (a decode TTFT would be a blank panel)."""
    names = metric_names(expr)
    if not names:
        return [f"reads no metric: {expr}"]
    known = exported()
    out = [f"{n}: no service exports it" for n in sorted(names - known.keys())]
    for role in sorted(roles_named(expr)):
        if role not in ROLES:
            out.append(f"role {role!r} is none of {ROLES}")
            continue
        out += [f"{n}: the {role} role does not export it" for n in sorted(names & known.keys())
                if role not in known[n]]
    return out


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression of a dashboard: its panels' targets (rows' nested panels too) and its query
    variables (`label_values(expr, label)`)."""
    out: list[str] = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if "expr" in t)
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
            out.append(m.group(1) if m else q)
    return out


def _panels(dashboard: dict) -> list[dict]:
    return [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]


def _datasources(node) -> list:
    if isinstance(node, dict):
        return ([node["datasource"]] if "datasource" in node else []) + [
            d for k, v in node.items() if k != "datasource" for d in _datasources(v)]
    if isinstance(node, list):
        return [d for v in node for d in _datasources(v)]
    return []


@pytest.fixture(params=DASHBOARDS, ids=lambda p: p.name)
def dashboard(request) -> dict:
    return json.loads(request.param.read_text())


def test_there_is_a_dashboard():
    assert [p.name for p in DASHBOARDS] == ["pdserve.json"]


def test_the_checks_know_the_exported_names():
    known = exported()
    assert known["pdserve:time_to_first_token_seconds_bucket"] == {"router", "prefill"}
    assert known["pdserve:request_migrations_total"] == {"router"}
    assert known["pdserve:service_info"] == set(ROLES)
    assert {"vllm:num_requests_waiting", "vllm:cache_config_info", "vllm:lora_requests_info"} <= known.keys()
    assert "pdserve:request_migrations" not in known and "pdserve:kv_cache_usage_perc_total" not in known
    expr = ('histogram_quantile(0.9, sum by (le) (rate(pdserve:x_bucket{a="b:c", d=~"$job"}[$__rate_interval])'
            ' and on (job, instance) pdserve:service_info{role="decode"})) / ignoring (phase) group_left vllm:y 1e3')
    assert metric_names(expr) == {"pdserve:x_bucket", "pdserve:service_info", "vllm:y"}
    assert roles_named(expr) == {"decode"} and roles_named('x{role=~"prefill|decode"}') == {"prefill", "decode"}


def test_the_dashboard_imports_anywhere(dashboard):
    (ds,) = dashboard["__inputs"]
    assert ds == {**ds, "name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}
    assert {r["id"] for r in dashboard["__requires"]} >= {"grafana", "prometheus", "timeseries"}
    sources = _datasources(dashboard)
    assert sources and all(s == DATASOURCE for s in sources), [s for s in sources if s != DATASOURCE]
    assert dashboard["uid"] and dashboard["title"] and "id" not in dashboard  # a fresh import, not an export's id
    panels = _panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        assert p["type"] == "row" or (p["targets"] and p.get("description")), p["title"]


def test_every_metric_the_dashboard_reads_is_exported(dashboard):
    found = [f"{p}" for e in expressions(dashboard) for p in problems(e)]
    assert not found, "\n".join(found)


def test_percentiles_read_histogram_buckets(dashboard):
    quantiles = [e for e in expressions(dashboard) if "histogram_quantile" in e]
    assert len(quantiles) >= 10
    for e in quantiles:
        assert all(n.endswith("_bucket") or n == "pdserve:service_info" for n in metric_names(e)), e
        assert re.search(r"by \([^)]*\ble\b", e), f"the buckets must keep `le`: {e}"


def test_the_dashboard_shows_what_a_pd_system_has(dashboard):
    used = {n for e in expressions(dashboard) for n in metric_names(e)}
    want = {f"pdserve:{n}" for n in (
        "e2e_request_latency_seconds_count", "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket", "num_requests_waiting",
        "num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total", "prefix_cache_queries_total",
        "nixl_bytes_transferred_total", "nixl_num_failed_transfers_total", "kv_pull_failures_total",
        "kv_pull_recomputes_total", "kv_pull_not_intact_total", "kvstore_num_stored_blocks",
        "kvstore_evictions_total", "hisparse_hits_total", "hisparse_misses_total", "hisparse_h2d_bytes_total",
        "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total",
        "request_migrations_total", "kv_lease_expired_total", "engine_step_phase_seconds_total", "service_info")}
    assert not want - used, sorted(want - used)
    per_role = [e for e in expressions(dashboard) if "prefix_cache_hits_total" in e and "by (role)" in e]
    assert per_role, "the prefix-cache hit rate is shown per role (router, engines, kvstore)"


@pytest.mark.parametrize("old, new, why", [
    ("pdserve:request_migrations_total", "pdserve:made_up_total", "no service exports it"),
    ("pdserve:request_migrations_total", "made_up_metric", "no service exports it"),
    ("pdserve:request_migrations_total", "pdserve:request_migrations", "no service exports it"),  # suffix lost
    ("pdserve:kv_cache_usage_perc", "pdserve:kv_cache_usage_perc_total", "no service exports it"),
    ('role="decode"}))', 'role="prefill"}))', "the prefill role does not export it"),  # decode TPOT
    ("rate(", "rat(", "unknown PromQL function"),
])
def test_the_check_can_fail(dashboard, old, new, why):
    broken = copy.deepcopy(dashboard)
    targets = [t for p in _panels(broken) for t in p.get("targets", []) if old in t["expr"]]
    assert targets, f"no expression holds {old!r}"
    targets[0]["expr"] = targets[0]["expr"].replace(old, new)
    try:
        found = [p for e in expressions(broken) for p in problems(e)]
    except ValueError as exc:
        found = [str(exc)]
    assert any(why in p for p in found), found

"""deploy/k8s/autoscaling: KEDA ScaledObjects (a CRD, so checked field by field here) and the HPA alternative
(validated against the Kubernetes schema offline, strict, as test_k8s.py does). Each scales one workload of
deploy/k8s on its own role's metrics, every metric its queries read is one the services export
(test_dashboards.py's check), the engines scale one at a time with a scale-in that lets a drain finish, and the
two alternatives hold the same bounds, behavior and targets."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

from tests.helpers import ROOT
from tests.unit.services.launch.test_dashboards import metric_names, problems, roles_named

K8S = ROOT / "deploy" / "k8s"
AUTOSCALING = K8S / "autoscaling"
K8S_VERSION = "1.33.0"
ADAPTER_VALUES = "prometheus-adapter.values.yaml"
SCALED_OBJECT_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                      "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "ignoreNullValues",
                       "queryParameters", "namespace", "customHeaders", "unsafeSsl"}
ENGINE_LOAD_S = 600  # about how long an 8-GPU engine takes from pod start to ready (the startup probe allows 1,800)


def _docs(folder: str) -> list[dict]:
    """The objects a kustomization under autoscaling/ applies, in its order."""
    root = AUTOSCALING / folder
    listed = yaml.safe_load((root / "kustomization.yaml").read_text())["resources"]
    return [d for f in listed for d in yaml.safe_load_all((root / f).read_text()) if d]


def _workloads() -> dict[str, dict]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("StatefulSet", "Deployment")}


def _by_name(folder: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs(folder)}


def _adapter() -> dict:
    return yaml.safe_load((AUTOSCALING / "hpa" / ADAPTER_VALUES).read_text())


def _target_problems(ref: dict) -> list[str]:
    w = _workloads().get(ref.get("name"))
    if w is None:
        return [f"scaleTargetRef {ref.get('name')!r} is no workload of deploy/k8s ({sorted(_workloads())})"]
    if (ref.get("apiVersion"), ref.get("kind")) != (w["apiVersion"], w["kind"]):
        return [f"scaleTargetRef {ref} is not {w['apiVersion']} {w['kind']}"]
    return []


def _behavior_problems(name: str, ref: dict, behavior: dict) -> list[str]:
    """The behavior inside an autoscaling/v2 HPA, checked against the Kubernetes schema (KEDA hands it over as is)."""
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": name, "namespace": "pdserve"},
           "spec": {"scaleTargetRef": ref, "maxReplicas": 1, "behavior": behavior}}
    try:
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"behavior: {exc}"]
    return []


def scaled_object_problems(doc: dict) -> list[str]:
    """What keeps a ScaledObject from scaling its workload on its own role's signals."""
    if (doc.get("apiVersion"), doc.get("kind")) != ("keda.sh/v1alpha1", "ScaledObject"):
        return [f"not a keda.sh/v1alpha1 ScaledObject: {doc.get('apiVersion')} {doc.get('kind')}"]
    meta, spec = doc.get("metadata", {}), doc.get("spec", {})
    out = [] if meta.get("name") and meta.get("namespace") == "pdserve" else ["metadata: a name, namespace pdserve"]
    out += [f"spec.{k}: not a ScaledObject field" for k in sorted(set(spec) - SCALED_OBJECT_SPEC)]
    ref = spec.get("scaleTargetRef", {})
    out += _target_problems(ref)
    lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if not 1 <= lo <= hi:
        out.append(f"replicas {lo}..{hi}: need 1 <= min <= max (never to zero: an engine loads for minutes)")
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    out += _behavior_problems(meta.get("name", "x"), ref, behavior) if behavior else ["no scaling behavior"]
    triggers = spec.get("triggers") or []
    if not triggers or len({t.get("name") for t in triggers}) != len(triggers):
        out.append("triggers: at least one, each with a name of its own")
    for t in triggers:
        md = t.get("metadata", {})
        if t.get("type") != "prometheus" or t.get("metricType") not in ("AverageValue", "Value"):
            out.append(f"{t.get('name')}: a prometheus trigger with metricType AverageValue or Value")
        out += [f"{t.get('name')}: metadata.{k} unknown" for k in sorted(set(md) - PROMETHEUS_METADATA)]
        if not {"serverAddress", "query", "threshold"} <= set(md) or not all(isinstance(v, str) for v in md.values()):
            out.append(f"{t.get('name')}: serverAddress, query and threshold, every value a string")
            continue
        if not float(md["threshold"]) > 0:
            out.append(f"{t.get('name')}: threshold {md['threshold']} must be > 0")
        out += [f"{t.get('name')}: {p}" for p in problems(md["query"])]
        if roles_named(md["query"]) != {ref.get("name")}:
            out.append(f"{t.get('name')}: reads roles {roles_named(md['query'])}, not its own {ref.get('name')!r}")
    return out


@pytest.mark.parametrize("folder", ["keda", "hpa"])
def test_kustomizations_list_every_manifest(folder):
    listed = yaml.safe_load((AUTOSCALING / folder / "kustomization.yaml").read_text())["resources"]
    files = {f.name for f in (AUTOSCALING / folder).glob("*.yaml")} - {"kustomization.yaml", ADAPTER_VALUES}
    assert sorted(listed) == sorted(files)
    assert {d["kind"] for d in _docs(folder)} == {"keda": {"ScaledObject"}, "hpa": {"HorizontalPodAutoscaler"}}[folder]


def test_the_autoscalers_stay_out_of_the_base():
    """`kubectl apply -k deploy/k8s` needs no CRD and no metrics pipeline; autoscaling is applied on top, by choice."""
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert not [r for r in base if "autoscaling" in r]


@pytest.mark.parametrize("name", ["prefill", "decode", "router"])
def test_scaled_objects_scale_their_workload_on_its_own_signals(name):
    doc = _by_name("keda")[name]
    assert not scaled_object_problems(doc), scaled_object_problems(doc)
    assert doc["spec"]["scaleTargetRef"]["name"] == name


@pytest.mark.parametrize("path, value, why", [
    (("spec", "scaleTargetRef", "name"), "prefil", "no workload of deploy/k8s"),
    (("spec", "scaleTargetRef", "kind"), "Deployment", "is not apps/v1 StatefulSet"),
    (("spec", "minReplicaCount"), 5, "1 <= min <= max"),
    (("spec", "minReplicaCount"), 0, "1 <= min <= max"),
    (("spec", "maxReplicas"), 4, "not a ScaledObject field"),
    (("spec", "triggers", 0, "metadata", "query"), "sum(pdserve:num_requests_waitin)", "no service exports it"),
    (("spec", "triggers", 0, "metadata", "query"), 'sum(pdserve:num_requests_waiting and on (job, instance) '
     'pdserve:service_info{role="decode"})', "not its own 'prefill'"),
    (("spec", "triggers", 1, "metadata", "threshold"), 2, "every value a string"),
    (("spec", "triggers", 1, "metricType"), "Utilization", "metricType AverageValue or Value"),
    (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown", "stabilisationWindowSeconds"),
     1800, "behavior"),
])
def test_the_scaled_object_check_can_fail(path, value, why):
    doc = copy.deepcopy(_by_name("keda")["prefill"])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    found = scaled_object_problems(doc)
    assert any(why in p for p in found), found


@pytest.mark.parametrize("name", ["prefill", "decode", "router"])
def test_hpas_pass_the_kubernetes_schema(name):
    doc = _by_name("hpa")[name]
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert doc["metadata"]["namespace"] == "pdserve" and not _target_problems(doc["spec"]["scaleTargetRef"])
    assert 1 <= doc["spec"]["minReplicas"] <= doc["spec"]["maxReplicas"]


def test_the_hpa_validation_can_fail():
    bad = copy.deepcopy(_by_name("hpa")["prefill"])
    bad["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = bad["spec"]["metrics"][0]["pods"]["target"].pop(
        "averageValue")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_engines_scale_one_at_a_time_and_drain_on_scale_in(name):
    """An engine replica is a whole 8-GPU node that loads for minutes: add one, then wait for it to load and take
    load before judging again; give one back only after a long lull, and only once the last one's drain
    (terminationGracePeriodSeconds, which holds --shutdown-timeout) had time to finish."""
    spec = _by_name("keda")[name]["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    grace_s = _workloads()[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    (up,), (down,) = behavior["scaleUp"]["policies"], behavior["scaleDown"]["policies"]
    assert up["type"] == down["type"] == "Pods" and up["value"] == down["value"] == 1
    assert up["periodSeconds"] >= ENGINE_LOAD_S
    assert down["periodSeconds"] >= grace_s, (down["periodSeconds"], grace_s)
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 2 * ENGINE_LOAD_S
    assert spec["minReplicaCount"] >= 1


def _adapter_metrics() -> dict[str, tuple[str, dict]]:
    """The metric names prometheus-adapter serves -> ("custom" | "external", its rule)."""
    out = {}
    for kind in ("custom", "external"):
        for rule in _adapter()["rules"][kind]:
            (series,) = metric_names(rule["seriesQuery"])
            as_ = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
            out[re.sub(rule["name"]["matches"], as_, series)] = (kind, rule)
    return out


def _adapter_query(rule: dict) -> str:
    """A rule's metricsQuery as the adapter sends it for the pdserve namespace."""
    (series,) = metric_names(rule["seriesQuery"])
    q = rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.GroupBy>>", "pod")
    return q.replace("<<.LabelMatchers>>", 'namespace="pdserve"')


def test_the_adapter_rules_read_exported_metrics():
    served = _adapter_metrics()
    assert len(served) == len(_adapter()["rules"]["custom"]) + len(_adapter()["rules"]["external"])
    for name, (kind, rule) in served.items():
        assert not problems(rule["seriesQuery"]) and not problems(_adapter_query(rule)), name
        assert re.fullmatch(r"[a-z0-9_]+", name), f"{name}: a name the metrics APIs take"
        want = {"namespace": {"resource": "namespace"}} | ({"pod": {"resource": "pod"}} if kind == "custom" else {})
        assert rule["resources"]["overrides"] == want, name


@pytest.mark.parametrize("name", ["prefill", "decode", "router"])
def test_keda_and_the_hpa_agree(name):
    """Two ways to one scaling: the same bounds, the same behavior, each KEDA trigger an HPA metric of its name
    with the same target (AverageValue: a Pods or External average; Value: an External value), and an External
    metric reading the same role as the trigger."""
    keda, hpa = _by_name("keda")[name]["spec"], _by_name("hpa")[name]["spec"]
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    assert keda["scaleTargetRef"] == hpa["scaleTargetRef"]
    metrics = {m[m["type"].lower()]["metric"]["name"]: m for m in hpa["metrics"]}
    assert sorted(metrics) == sorted(t["name"] for t in keda["triggers"])
    served = _adapter_metrics()
    for t in keda["triggers"]:
        m = metrics[t["name"]]
        target = m[m["type"].lower()]["target"]
        key = {"AverageValue": "averageValue", "Value": "value"}[t["metricType"]]
        assert target["type"] == t["metricType"] and float(target[key]) == float(t["metadata"]["threshold"]), t["name"]
        kind, rule = served[t["name"]]
        assert kind == {"Pods": "custom", "External": "external"}[m["type"]], t["name"]
        if kind == "external":
            assert roles_named(_adapter_query(rule)) == roles_named(t["metadata"]["query"]) == {name}


def test_prometheus_scrapes_every_pdserve_service():
    """podmonitor.yaml selects every pdserve pod with a metrics port, by the port's name, and that port is the
    one each service serves /metrics on (--metrics-port)."""
    (monitor,) = yaml.safe_load_all((AUTOSCALING / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["metadata"]["namespace"] == "pdserve"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for name in ("router", "prefill", "decode", "kvstore"):
        template = _workloads()[name]["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        (c,) = template["spec"]["containers"]
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == endpoint["port"])
        assert c["command"][c["command"].index("--metrics-port") + 1] == str(port), name

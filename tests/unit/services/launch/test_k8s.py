"""deploy/k8s: every manifest passes the Kubernetes schema offline (kubernetes-validate, strict: an
unknown field fails), and the manifests run what the two-host topology files run: the same flags,
8 GPUs for the prefill pod and for the decode group's pod, shared memory, health probes, the NCCL settings."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from services.launch import topology
from services.launch.topology import Ports
from tests.helpers import ROOT

K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"  # gRPC probes are GA since 1.27
PER_POD = {"--advertise-host", "--instance-id", "--redis-url"}  # from the pod's environment instead
RANK_FLAGS = {"--rank", "--world-size", "--master-addr", "--master-port"}


def _docs() -> list[tuple[str, dict]]:
    return [(f.name, d) for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]


def _by(kind: str, name: str) -> dict:
    return next(d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(kind: str, name: str) -> dict:
    (c,) = _by(kind, name)["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("name, doc", _docs(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_passes_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert doc["metadata"].get("namespace", "pdserve") == "pdserve"


def test_the_validation_can_fail():
    bad = yaml.safe_load((K8S / "router.yaml").read_text().split("---")[0])
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def _flags(argv: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i]], i = "", i + 1
    return out


@pytest.mark.parametrize("host_file, kind, workload", [("prefill-host.yaml", "prefill", "StatefulSet"),
                                                      ("prefill-host.yaml", "kvstore", "StatefulSet"),
                                                      ("prefill-host.yaml", "router", "Deployment"),
                                                      ("decode-host.yaml", "decode", "StatefulSet")])
def test_pods_run_the_flags_of_the_two_host_topology(host_file, kind, workload):
    topo = topology.load(ROOT / "configs" / "h200x16" / host_file)
    spec = topo.service(kind)
    ports = Ports(spec.port, spec.metrics_port, spec.extra.get("grpc_port", 0), master_port=1)
    want = _flags(topology.flags(topo, spec, 0, 0, ports, topo.redis_url))
    cmd = _container(workload, kind)["command"]
    if kind in ("prefill", "decode"):  # one engine group of 8 ranks per pod
        assert cmd[2:6] == ["services.launch.ranks", "--ranks", "8", f"services.{kind}"]
        cmd = cmd[6:]
    else:
        assert cmd[2] == f"services.{kind}"
        cmd = cmd[3:]
    got = _flags(cmd)
    skip = PER_POD | (RANK_FLAGS if kind in ("prefill", "decode") else set())
    assert set(got) == set(want) - skip, f"{kind}: {sorted(got)} vs {sorted(set(want) - skip)}"
    for flag in set(got) - {"--model"}:
        assert got[flag] == want[flag], f"{kind} {flag}: {got[flag]} vs {want[flag]}"


def test_gpus_shared_memory_probes_and_nccl():
    pre, dec = _by("StatefulSet", "prefill"), _by("StatefulSet", "decode")
    assert pre["spec"]["replicas"] == 1 and dec["spec"]["replicas"] == 1
    for sts, gpus in ((pre, "8"), (dec, "8")):
        pod = sts["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus == c["resources"]["requests"]["nvidia.com/gpu"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == c["ports"][0]["containerPort"]
        assert {"configMapRef": {"name": "pdserve-env"}} in c["envFrom"]
        assert c["env"][0]["name"] == "PDSERVE_ADVERTISE_HOST"  # the pod IP, never 0.0.0.0
        cache = next(v for v in pod["volumes"] if v["name"] == "compile-cache")  # compiled kernels outlive the pod
        assert cache["hostPath"]["type"] == "DirectoryOrCreate"
        assert {"name": "compile-cache", "mountPath": "/var/cache/pdserve"} in c["volumeMounts"]
    assert pre["spec"]["template"]["spec"]["nodeSelector"] != dec["spec"]["template"]["spec"]["nodeSelector"]
    router = _container("Deployment", "router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/health" and router["livenessProbe"]["grpc"]["port"] == 50050
    env = _by("ConfigMap", "pdserve-env")["data"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["PDSERVE_REDIS_URL"] == "redis://redis:6379/0" and "tcp" in env["UCX_TLS"]
    assert env["TRITON_CACHE_DIR"].startswith("/var/cache/pdserve/")
    assert env["PDSERVE_KERNEL_CACHE"].startswith("/var/cache/pdserve/")
    assert {p["port"] for p in _by("Service", "router")["spec"]["ports"]} == {8000, 50050}


@pytest.mark.parametrize("workload, name", [("Deployment", "router"), ("StatefulSet", "kvstore"),
                                            ("StatefulSet", "prefill"), ("StatefulSet", "decode")])
def test_the_grace_period_covers_the_drain(workload, name):
    """SIGTERM drains for up to --shutdown-timeout (services/rpc/drain.py); the kubelet's SIGKILL comes
    terminationGracePeriodSeconds after the preStop hook started, so the period must hold both."""
    pod = _by(workload, name)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    drain_s = float(_flags(c["command"])["--shutdown-timeout"])
    pause_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= drain_s + pause_s + 10, (name, pod["terminationGracePeriodSeconds"])

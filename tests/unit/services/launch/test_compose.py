"""docker-compose.yml: valid for docker-compose when it is installed, and in every case
structurally right: all services, decode scalable, and the same flags the launcher passes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.launch import topology
from services.launch.topology import Ports
from tests.helpers import ROOT

COMPOSE = ROOT / "docker-compose.yml"
ENGINE_KINDS = ("kvstore", "prefill", "decode", "router")
GPU_KINDS = ("prefill", "decode")  # each has a `<kind>-gpu` twin in the `gpu` profile (with router-gpu)
# Flags the launcher passes that containers derive themselves (their own IP and hostname).
PER_CONTAINER = {"--advertise-host", "--instance-id"}
RANK_FLAGS = {"--rank", "--world-size", "--master-addr", "--master-port"}  # added by services.launch.ranks


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _command(compose: dict, kind: str, service: str | None = None) -> list[str]:
    cmd = compose["services"][service or kind]["command"]
    assert cmd[:2] == ["python", "-m"], f"{kind}: command must be `python -m <module> ...`"
    if kind == "prefill":
        assert cmd[2:6] == ["services.launch.ranks", "--ranks", cmd[4], "services.prefill"]
        return cmd[6:]
    assert cmd[2] == f"services.{kind}"
    return cmd[3:]


def _flag_values(argv: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(argv):
        assert argv[i].startswith("--"), f"unexpected positional {argv[i]!r} in {argv}"
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i]], i = "", i + 1
    return out


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_docker_compose_config_accepts_the_file(profile):
    r = subprocess.run(["docker-compose", "-f", str(COMPOSE), *profile, "config", "-q"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_services_present_and_decode_scalable(compose):
    services = compose["services"]
    assert set(services) == {"redis", *ENGINE_KINDS, *(f"{k}-gpu" for k in (*GPU_KINDS, "router"))}
    decode = services["decode"]
    assert "container_name" not in decode and "ports" not in decode and "hostname" not in decode
    for kind in ENGINE_KINDS:
        s = services[kind]
        assert s["environment"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert "redis" in s["depends_on"], f"{kind} must start after redis"
        assert s["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "services.rpc.healthcheck"]
    assert "--save" in services["redis"]["command"] and "--appendonly" in services["redis"]["command"]
    assert "8000:8000" in services["router"]["ports"]


def test_flags_match_the_launcher(compose):
    topo = topology.load(ROOT / "configs" / "topology.cpu.yaml")
    assert {s.kind for s in topo.services} == set(ENGINE_KINDS)
    for spec in topo.services:
        ports = Ports(port=spec.port, metrics_port=spec.metrics_port, grpc_port=spec.extra.get("grpc_port", 0),
                      master_port=29500)
        launcher = _flag_values(topology.flags(topo, spec, 0, 0, ports, "redis://x:6379/0"))
        ours = _flag_values(_command(compose, spec.kind))
        expected = set(launcher) - PER_CONTAINER - (RANK_FLAGS if spec.kind == "prefill" else set())
        assert set(ours) == expected, f"{spec.kind}: compose {sorted(ours)} vs launcher {sorted(expected)}"
        for flag in expected - {"--model", "--redis-url", "--host"}:  # same ports, sizes, dtypes
            assert ours[flag] == launcher[flag], f"{spec.kind} {flag}: {ours[flag]} vs {launcher[flag]}"
        assert Path(ours["--model"]).name == Path(launcher["--model"]).name
        assert ours["--redis-url"] == compose["services"][spec.kind]["environment"]["PDSERVE_REDIS_URL"]
    ranks = compose["services"]["prefill"]["command"][4]
    assert int(ranks) == topo.service("prefill").ranks


def test_containers_bind_all_interfaces_explicitly(compose):
    """Services bind loopback by default; in containers peers dial the container IP, so every
    service's command must ask for 0.0.0.0 itself."""
    for kind in ENGINE_KINDS:
        assert _flag_values(_command(compose, kind)).get("--host") == "0.0.0.0", kind


def test_gpu_profile_reserves_gpus_and_runs_the_gpu_1_topology(compose):
    """`docker compose --profile gpu up router-gpu`: the engines of configs/topology.gpu-1.yaml on GPU 0,
    with the same flags as the launcher's (a CUDA image, a GPU reservation, room in /dev/shm)."""
    topo = topology.load(ROOT / "configs" / "topology.gpu-1.yaml")
    services = compose["services"]
    for kind in GPU_KINDS:
        s = services[f"{kind}-gpu"]
        assert s["profiles"] == ["gpu"] and "cuda" in s["image"] and "cu1" in s["build"]["args"]["TORCH_INDEX_URL"]
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert dev["device_ids"] == [str(g) for g in topo.service(kind).gpus]
        spec = topo.service(kind)
        ports = Ports(port=spec.port, metrics_port=spec.metrics_port, master_port=29500)
        launcher = _flag_values(topology.flags(topo, spec, 0, 0, ports, "redis://x:6379/0"))
        ours = _flag_values(_command(compose, kind, f"{kind}-gpu"))
        expected = set(launcher) - PER_CONTAINER - (RANK_FLAGS if kind == "prefill" else set())
        assert set(ours) == expected, f"{kind}-gpu: compose {sorted(ours)} vs launcher {sorted(expected)}"
        for flag in expected - {"--model", "--redis-url", "--host"}:
            assert ours[flag] == launcher[flag], f"{kind}-gpu {flag}: {ours[flag]} vs {launcher[flag]}"
        assert s["environment"]["NCCL_NVLS_ENABLE"] == "0"
        # compiled kernels on a named volume: a restarted engine does not compile them again under traffic
        assert "compile-cache:/var/cache/pdserve" in s["volumes"] and "compile-cache" in compose["volumes"]
        for var in ("TRITON_CACHE_DIR", "PDSERVE_KERNEL_CACHE"):
            assert s["environment"][var].startswith("/var/cache/pdserve/")
    router = services["router-gpu"]
    assert router["profiles"] == ["gpu"] and set(router["depends_on"]) == {"redis", "prefill-gpu", "decode-gpu"}
    for kind in ENGINE_KINDS:  # the default (no profile) set never waits on a GPU service
        assert not any(d.endswith("-gpu") for d in services[kind].get("depends_on", {}))

"""engine.settings: typed accessors read at call time, errors that name the variable, the standard library only,
and docs/settings.md listing every variable it reads."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from engine import settings
from tests.helpers import ROOT


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "3")
    assert settings.cpu_threads() == 3
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "")
    assert settings.cpu_threads() == 1, "empty is unset"
    monkeypatch.setenv("PDSERVE_API_KEY", " a , b:team ,,")
    assert settings.api_keys() == ("a", "b:team")
    monkeypatch.setenv("PDSERVE_NIXL_PROGRESS_THREAD", "Yes")
    assert settings.nixl_progress_thread()
    monkeypatch.setenv("PDSERVE_NIXL_PROGRESS_THREAD", "0")
    assert not settings.nixl_progress_thread()
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", "/x/y")
    assert str(settings.kernel_cache_dir()) == "/x/y"
    monkeypatch.delenv("RANK", raising=False)
    assert settings.dist_rank() is None
    monkeypatch.setenv("RANK", "2")
    assert settings.dist_rank() == 2


@pytest.mark.parametrize("name,value,read", [
    ("PDSERVE_CPU_THREADS", "two", settings.cpu_threads),
    ("PDSERVE_CPU_THREADS", "0", settings.cpu_threads),
    ("RANK", "r1", settings.dist_rank),
    ("PDSERVE_DIST_DEVICE", "tpu", settings.dist_device),
    ("PDSERVE_NIXL_PROGRESS_THREAD", "maybe", settings.nixl_progress_thread),
    ("PDSERVE_NIXL_IDLE_POLL_S", "2", settings.nixl_idle_poll_s),
    ("PDSERVE_RANK_HANG_TIMEOUT_S", "-1", settings.rank_hang_timeout_s),
    ("PDSERVE_SWITCH_INTERVAL_MS", "0", settings.switch_interval_ms),
    ("PDSERVE_FAULT_NIXL_FAIL_FIRST_N", "x", settings.fault_nixl_fail_first_n),
])
def test_a_bad_value_names_its_variable(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        read()


def test_setting_this_process_as_a_rank(monkeypatch):
    # a private copy of the environment: what set_torchrun_environ writes must not outlive the test (a later
    # test in this worker would find itself a rank)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")})
    assert settings.assigned_local_rank() is None and settings.dist_local_rank() == 0
    settings.set_torchrun_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "LOCAL_RANK": "1"})
    assert (settings.dist_rank(), settings.dist_world_size(), settings.dist_master_port()) == (1, 2, 29500)
    assert settings.assigned_local_rank() == 1


def test_only_the_standard_library_is_imported():
    """The bottom floor: kernels import it, so it must not pull in torch (or anything of the tree)."""
    tree = ast.parse((ROOT / "engine" / "settings.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names
    code = "import sys, engine.settings; print(sorted(m for m in ('torch', 'triton', 'kernels') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", "importing engine.settings must stay cheap (engine/__init__.py is lazy)"


def test_every_variable_read_is_documented():
    read = set(re.findall(r'"((?:PDSERVE_|TRITON_|CUDA_|TORCHELASTIC_)[A-Z_]+|RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR'
                          r'|MASTER_PORT)"', (ROOT / "engine" / "settings.py").read_text()))
    table = (ROOT / "docs" / "settings.md").read_text()
    assert len(read) > 20
    missing = sorted(name for name in read if f"`{name}`" not in table)
    assert not missing, f"add these to docs/settings.md: {missing}"


def test_the_environment_is_read_here_only():
    """`os.environ` (or `getenv`) appears in the settings module alone, and in the two places that start child
    processes, which pass their whole environment on."""
    spawners = {"engine/parallel/spawn.py", "services/launch/launcher.py"}
    hits = set()
    for pkg in ("engine", "kernels", "services", "planner"):
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            if "os.environ" in text or "getenv(" in text:
                hits.add(str(f.relative_to(ROOT)))
    assert hits - spawners == {"engine/settings.py"}, sorted(hits)

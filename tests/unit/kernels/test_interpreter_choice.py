"""Triton's interpreter is chosen in one place (kernels/triton_support.py, through engine.settings) before
Triton's first import: importing any kernel module directly, in a fresh process on a CPU-only torch, gets it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

cpu_only = pytest.mark.skipif(torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None,
                              reason="a CUDA or ROCm torch compiles kernels: the interpreter is not the default")


@cpu_only
@pytest.mark.parametrize("module", ["kernels.hisparse_plan", "kernels.hisparse_gather", "kernels.fp8_gemm"])
def test_a_direct_import_gets_the_interpreter(module):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import {module}; from kernels.triton_support import interpreting; print(interpreting())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr


def test_no_kernel_module_chooses_it_again():
    """The choice is made once: no module but engine/settings.py names the variable to set it."""
    setters = [p.name for p in (ROOT / "kernels").rglob("*.py") if "setdefault(\"TRITON_INTERPRET\"" in p.read_text()
               or "environ[\"TRITON_INTERPRET\"]" in p.read_text()]
    assert not setters, setters

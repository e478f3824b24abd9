"""Compile Triton kernels for the H100/H200 (sm_90) on a machine without a GPU.

The CPU suite runs every kernel through Triton's interpreter, which accepts programs the compiler
rejects (a name rebound to another shape inside an `if`, say). Triton's front end and ptxas need no GPU,
so a subprocess with the interpreter off can build the cubin of a kernel for a chosen target: a kernel
that does not compile for the H200 fails in CI instead of on the first GPU run.

    compile_sm90(code)   runs `code` in a fresh interpreter where `build(kernel, signature, constexprs,
                         num_warps=, num_stages=)` compiles one specialisation and returns its cubin size
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kernels.triton_support  # noqa: F401 (decides interpreter or compiler before `nvidia_backend` imports Triton)

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = '''
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def build(kernel, signature, constexprs, num_warps=4, num_stages=3):
    names = list(signature) + [k for k in constexprs if k not in signature]
    sig = {k: signature.get(k, "constexpr") for k in names}
    missing = [a for a in kernel.arg_names if a not in sig]
    if missing:
        raise ValueError(f"{kernel.__name__}: no type for {missing}")
    sig = {a: sig[a] for a in kernel.arg_names}
    consts = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    out = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=TARGET,
                         options={"num_warps": num_warps, "num_stages": num_stages})
    return len(out.asm["cubin"])
'''


def nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


def compile_sm90(code: str, timeout: float = 300) -> str:
    """Run `code` after PRELUDE in a fresh Python (interpreter off); its stdout, or AssertionError with the
    compiler's message."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"compiling for sm_90 failed:\n{proc.stderr[-4000:]}")
    return proc.stdout

"""Triton plumbing shared by the kernel files: interpreter selection, launch checks, small helpers.

Triton decides at import whether `triton.jit` compiles or interprets (TRITON_INTERPRET), and its own
library functions (`tl.max`, `tl.cumsum`, ...) are decorated then too. With a CPU-only torch build no
kernel can be compiled, so the interpreter is switched on before Triton is first imported: CI and CPU
machines run every kernel through it with no flag to remember. A CUDA build compiles; its tests of the
interpreter set TRITON_INTERPRET=1 themselves.
"""

from __future__ import annotations

import os
import sys

import torch

if torch.version.cuda is None and getattr(torch.version, "hip", None) is None and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

jit = triton.jit


def interpreting() -> bool:
    """True when kernels run in Triton's interpreter (where bf16 `tl.dot` is wrong: STYLE §9)."""
    return bool(triton.knobs.runtime.interpret)


def check_device(*tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that this Triton can launch on; returns it."""
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"tensors on {dev} need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                         "triton, or use the *_ref functions")
    return dev


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill (a small stand-in under the interpreter, to keep split logic exercised)."""
    if device.type != "cuda" or interpreting():
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---- device helpers ---------------------------------------------------------------------------------
# Triton 3.9's interpreter narrows floats by keeping the top mantissa bits plus the first cut-off bit:
# ties are not broken to even and a carry out of the mantissa is lost. Data-movement kernels must match
# torch bit for bit, so under the interpreter they round onto the target grid first (exact RNE in fp32
# arithmetic or integer ops); the narrowing cast then drops only zero bits. Compiled code uses the
# hardware conversions (round-to-nearest-even) and skips this.

@triton.jit
def to_bf16(x, ROUND_FIRST: tl.constexpr):
    """fp32 -> bf16, round to nearest even (finite inputs)."""
    if ROUND_FIRST:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def to_e4m3(v, ROUND_FIRST: tl.constexpr):
    """fp32 in [-448, 448] -> fp8 e4m3 bytes (uint8), round to nearest even."""
    if ROUND_FIRST:
        e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3 ulp = 2^(e-3)
        magic = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True) * 1.5  # a number whose fp32 ulp is 2^(e-3)
        r = (tl.abs(v) + magic) - magic
        v = (r.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

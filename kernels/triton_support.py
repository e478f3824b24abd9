"""Triton plumbing shared by the kernel files: interpreter selection, launch checks, small helpers.

Triton decides at import whether `triton.jit` compiles or interprets (TRITON_INTERPRET), and its own
library functions (`tl.max`, `tl.cumsum`, ...) are decorated then too. With a CPU-only torch build no
kernel can be compiled, so the interpreter is switched on before Triton is first imported: CI and CPU
machines run every kernel through it with no flag to remember. A CUDA build compiles; its tests of the
interpreter set TRITON_INTERPRET=1 themselves. This is the one place the choice is made: every kernel module
is imported through the `kernels` package, whose `__init__` imports this module first.
"""

from __future__ import annotations

import logging
import sys

import torch

from engine import settings

if torch.version.cuda is None and getattr(torch.version, "hip", None) is None and "triton" not in sys.modules:
    settings.default_to_triton_interpreter()

import triton
import triton.language as tl

jit = triton.jit


def interpreting() -> bool:
    """True when kernels run in Triton's interpreter (where bf16 `tl.dot` is wrong: docs/conventions.md, "Kernels")."""
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
def on_bf16_grid(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32 (finite inputs), in integer ops. An eager bf16
    op's rounding of an intermediate result: compiled, a `.to(bf16).to(fp32)` pair may be dropped and the
    product before it contracted into the next sum (measured on the H200: kernels/rope.py)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x, ROUND_FIRST: tl.constexpr):
    """fp32 -> bf16, round to nearest even (finite inputs)."""
    if ROUND_FIRST:
        x = on_bf16_grid(x)
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


@triton.jit
def quant_e4m3_rows(x, ROUND_FIRST: tl.constexpr):
    """[R, 128] fp32 (zeros past the end of K) -> (e4m3 bytes uint8 [R, 128], fp32 scale per row [R]): the
    activation quantization of kernels.fp8_gemm, scale = max(amax, 1e-10) / 448, code = RNE(x / scale)."""
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    v = tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0)
    return to_e4m3(v, ROUND_FIRST), s


# ---- launching -----------------------------------------------------------------------------------------

class CompiledKernel:
    """A Triton kernel launched through the handle its first launch compiled, for the per-step kernels of a
    decode loop: a launch through `kernel[grid](...)` costs about 30 us of host time on an H200 host (its
    argument binding, cache key, hooks and global checks), the compiled launcher alone about 10 us
    (BENCHMARKS.md, HiSparse launch cost). Compiled handles are kept by what Triton specialises a kernel on:
    per argument, a tensor's dtype and 16-byte alignment, an int's being 1, a multiple of 16 or beyond 32 bits,
    any other value as it is; plus the constexprs and warps. A first launch of a key, the interpreter, or a
    launch hook (a profiler) goes through the JIT."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}
        self.use_jit = interpreting()  # the interpreter is decided at import (interpreting() reads the env)

    def __call__(self, grid: tuple, args: tuple, consts: dict, num_warps: int) -> None:
        if self.use_jit or not _no_launch_hooks():
            self.fn[grid](*args, **consts, num_warps=num_warps)
            return
        device = torch._C._cuda_getDevice()  # the JIT launches on the current device too
        key = (device, num_warps, *consts.values(), *map(_spec, args))
        k = self.compiled.get(key)
        if k is None:
            names = list(self.fn.arg_names)
            if names[len(args):] != list(consts):  # the launcher takes every parameter in signature order
                raise ValueError(f"{self.fn.__name__}: pass positional arguments, then {names[len(args):]} "
                                 "as constexprs")
            self.compiled[key] = self.fn[grid](*args, **consts, num_warps=num_warps)
            return
        g = (*grid, 1, 1)
        try:
            k.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), k.function, k.packed_metadata, None,
                  None, None, *args, *consts.values())
        except (TypeError, AttributeError, RuntimeError) as e:  # a Triton whose launcher differs: use the JIT
            logging.getLogger(__name__).warning("%s: direct launch failed (%s); launching through the JIT",
                                                self.fn.__name__, e)
            self.use_jit = True
            self.fn[grid](*args, **consts, num_warps=num_warps)


def _no_launch_hooks() -> bool:
    """No launch hook is installed (None in some Triton releases, an empty HookChain in others)."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is None or getattr(hook, "calls", None) == []


def _spec(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int) and not isinstance(a, bool):
        return a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)
    return a

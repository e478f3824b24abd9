"""Which compiled variants of each Triton kernel a workload needs, counted on the CPU.

A compiled Triton kernel is specialised on its launch arguments: every constexpr's value, and by default
each integer's class (equal to 1, a multiple of 16, or neither) and each pointer's alignment (16 bytes or
not). A new combination compiles a new variant, which takes 0.5-2 s on the first launch in a process (on an
H100: a cold tiny-code service spent its first 2 minutes of c = 4 traffic mostly compiling, 94 variants;
bench/data/simulate/NOTES.md). An argument that changes with the batch (a row count, a context length, a
slice of a per-step buffer) multiplies the variants a server meets under load, so kernels mark those
`do_not_specialize` / `do_not_specialize_on_alignment`.

Under the interpreter nothing compiles, but Triton's own binder still says which variant a launch would
need: `count_variants()` wraps every interpreted launch, asks the binder of the same kernel for sm_90, and
records the variant. tests/kernels/test_jit_variants.py uses it to check that the per-step kernels need one
variant whatever the step's row counts and context.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from kernels.triton_support import interpreting

_KEYS = ("do_not_specialize", "do_not_specialize_on_alignment")


class Variants:
    """{kernel name: {variant key}}, and which arguments took more than one class."""

    def __init__(self):
        self.seen: dict[str, set[str]] = defaultdict(set)
        self.args: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # kernel: {arg: classes}

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in sorted(self.seen.items(), key=lambda kv: -len(kv[1]))}

    def varying(self) -> dict[str, dict[str, list[str]]]:
        """{kernel: {argument: the classes it took}} for the arguments that took more than one: what multiplies
        a kernel's variants."""
        return {k: {a: sorted(c) for a, c in args.items() if len(c) > 1}
                for k, args in self.args.items() if any(len(c) > 1 for c in args.values())}


@contextlib.contextmanager
def count_variants():
    """Within the block, every interpreted Triton launch records the compiled variant it would need (sm_90)."""
    if not interpreting():
        raise RuntimeError("count_variants runs under Triton's interpreter (a CPU torch, or TRITON_INTERPRET=1)")
    # Triton's compiler side (the CUDA backend's binder), loaded only while counting: no kernel module needs it
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    out, binders = Variants(), {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        bind = binders.get(self.fn)
        if bind is None:
            jf = JITFunction(self.fn, **{k: v for k, v in self.kwargs.items() if k in _KEYS and v})
            bind = binders[self.fn] = create_function_from_signature(jf.signature, jf.params, backend)
        params, spec, options = bind(*args, **kwargs)
        name = self.fn.__name__
        out.seen[name].add(f"{spec}|{sorted(options.items())}")
        for arg, cls in zip(params, spec):
            out.args[name][arg].add(str(cls))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield out
    finally:
        InterpretedFunction.run = original

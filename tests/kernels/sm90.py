"""Compile a Triton kernel for the H200 (sm_90) on a machine without a GPU, with the
ptxas that ships with Triton: the interpreter runs what the compiler may reject. Call
from a child process with TRITON_INTERPRET=0 (an interpreted session has replaced the
@triton.jit functions)."""
from __future__ import annotations


def compile_sm90(kern, types: list[str], const: dict, num_warps: int = 4, fp_fusion: bool = False,
                 divisible_ints: bool = False):
    """types: the run-time arguments' types, in order, after taking out those in `const`;
    parameters past them keep their defaults (constexprs, or None pointers). Pointer
    arguments get the 16-byte alignment hint the JIT gives aligned tensors; with
    `divisible_ints` the i32 ones get it too (the JIT's hint for ints that are multiples
    of 16, e.g. strides). fp_fusion: the launch's enable_fp_fusion (most kernels here
    launch with False; a kernel launched without the option compiles with True)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in kern.params if p.name not in const]
    assert len(types) <= len(names), f"{len(types)} types for the run-time arguments {names}"
    rest = names[len(types):]
    defaults = {p.name: p.default for p in kern.params if p.name in rest}
    missing = [p.name for p in kern.params if p.name in rest and not p.has_default]
    assert not missing, f"no type or value for {missing}"
    const = {**defaults, **const}
    names = names[:len(types)]
    sig = {n: "constexpr" if n in const else types[names.index(n)] for n in kern.arg_names}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in zip(names, types)
             if t[0] == "*" or (divisible_ints and t == "i32")}
    cx = {(kern.arg_names.index(k),): v for k, v in const.items()}
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion})


def run_in_child(module: str, func: str = "compile_sm90", args: tuple = (), timeout: int = 300) -> None:
    """Run <module>.<func>(*args) in a fresh interpreter-free process; assert it passed.
    module: a module of tests/kernels by name, or a dotted path from the repository root
    (e.g. tests.offload.test_compile); args: literals (passed by their repr)."""
    import os
    import subprocess
    import sys

    import pytest
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no CUDA backend to compile with")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = module if "." in module else f"tests.kernels.{module}"
    r = subprocess.run([sys.executable, "-c", f"from {path} import {func}; {func}(*{tuple(args)!r})"],
                       env={**os.environ, "TRITON_INTERPRET": "0"}, cwd=root, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]

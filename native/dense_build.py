"""Build description of the `ftdense` extension (dense CPU projections, native/dense/).

It reuses the expert executor's SIMD kernels and CPU-feature detection (native/src/kernels*.cpp,
cpu_features.cpp; contract in kernels.h) rather than carrying a second copy: one set of kernels
to tune. Like `ftnative`, no -march flag: the ISA is picked at run time from cpuid.
"""

from __future__ import annotations

import platform
from pathlib import Path

from setuptools import Extension

_NATIVE = Path(__file__).resolve().parent
_KERNELS = [
    "cpu_features.cpp",
    "kernels_scalar.cpp",
    "kernels_emu512.cpp",
    "kernels_bf16dot_scalar.cpp",
]
_X86 = ["kernels_avx2.cpp", "kernels_avx512.cpp", "kernels_bf16dot_avx512.cpp"]


def dense_extension() -> Extension:
    """The `ftdense` extension module."""
    from pybind11.setup_helpers import Pybind11Extension

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    root = _NATIVE.parent
    own = [
        _NATIVE / "dense" / n
        for n in (
            "bindings.cpp",
            "bindings_decode.cpp",
            "bindings_sparse.cpp",
            "bindings_fill.cpp",
            "row_fill.cpp",
            "sparse_attention.cpp",
            "pool.cpp",
            "dense_linear.cpp",
            "dense_linear_bf16.cpp",
            "rms_norm.cpp",
            "decode_step.cpp",
            "decode_layers.cpp",
            "rope.cpp",
            "decode_attention.cpp",
            "prefill_attention.cpp",
            "qlinear.cpp",
            "qmoe.cpp",
            "qdot_scalar.cpp",
            "tier_read.cpp",
        )
    ]
    if x86:
        own += [
            _NATIVE / "dense" / n
            for n in (
                "decode_attention_avx2.cpp",
                "prefill_attention_avx2.cpp",
                "prefill_attention_avx512.cpp",
                "prefill_attention_avx512bf16.cpp",
                "qdot_avx2.cpp",
                "qdot_vnni.cpp",
            )
        ]
    shared = [_NATIVE / "src" / n for n in (*_KERNELS, *(_X86 if x86 else []))]
    return Pybind11Extension(
        "ftdense",
        [str(p.relative_to(root)) for p in (*own, *shared)],  # setuptools wants relative paths
        include_dirs=[str((_NATIVE / d).relative_to(root)) for d in ("dense", "src")],
        # the headers too: without them setuptools skips a build after a header-only change
        depends=[
            str(p.relative_to(root)) for d in ("dense", "src") for p in (_NATIVE / d).glob("*.h")
        ],
        cxx_std=17,
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-fvisibility=hidden"],
        extra_link_args=["-pthread"],
        define_macros=[] if x86 else [("FTNATIVE_NO_X86", "1")],
    )

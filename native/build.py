"""Build description of the `ftnative` extension (the native CPU expert executor).

setup.py calls `extensions()`. One binary carries every ISA path: the AVX2 and AVX-512 kernels
are compiled with per-function `target` attributes and chosen at run time from cpuid, so the
build itself uses no -march flag and runs on any x86-64 (or other) machine; on non-x86 targets
only the scalar kernels are built.
"""

from __future__ import annotations

import platform
from pathlib import Path

from setuptools import Extension

_SRC = Path(__file__).resolve().parent / "src"
_COMMON = [
    "executor.cpp",
    "thread_pool.cpp",
    "cpu_features.cpp",
    "kernels_scalar.cpp",
    "kernels_emu512.cpp",
    "kernels_bf16dot_scalar.cpp",
]
# kernels_bf16dot_avx512.cpp carries its own target attribute (avx512bf16) like the others.
_X86 = ["kernels_avx2.cpp", "kernels_avx512.cpp", "kernels_bf16dot_avx512.cpp"]


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def extensions() -> list[Extension]:
    """The extension modules of the project: `ftnative` and `ftdense` (native/dense_build.py)."""
    from pybind11.setup_helpers import Pybind11Extension

    names = ["bindings.cpp", *_COMMON, *(_X86 if _is_x86() else [])]
    root = Path(__file__).resolve().parent.parent
    # setuptools wants sources relative to the project root.
    sources = [str((_SRC / n).relative_to(root)) for n in names]
    ext = Pybind11Extension(
        "ftnative",
        sources,
        include_dirs=[str(_SRC.relative_to(root))],
        depends=[str(p.relative_to(root)) for p in _SRC.glob("*.h")],  # (see dense_build.py)
        cxx_std=17,
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-fvisibility=hidden"],
        extra_link_args=["-pthread"],
        define_macros=[] if _is_x86() else [("FTNATIVE_NO_X86", "1")],
    )
    from native.dense_build import dense_extension  # type: ignore[import-not-found]

    return [ext, dense_extension()]

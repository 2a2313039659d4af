"""Which CPU kernel path "auto" takes: the best the CPU runs, or the one the environment forces.

``FREETOKEN_CPU_ISA`` (unset or "auto": the CPU's best) forces every native kernel that is asked
for "auto" onto one path, as on a CPU that has no more: "avx2", "scalar", or "avx512". Where the
CPU lacks AVX-512, "avx512" runs the AVX-512 kernel bodies on emulated 16-lane vectors
("emu512": slow, the same arithmetic), so the AVX-512 code is tested on an AVX2-only machine.
The expert executor (experts/cpu_executor.py) and the dense pool (native/dense_native.py)
both resolve "auto" here. A path given explicitly (a test's parameter, bench --isa) is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

ENV = "FREETOKEN_CPU_ISA"
CHOICES = ("auto", "avx512", "avx2", "scalar")
# A forced path the CPU lacks -> the portable emulation of the same kernel bodies.
_EMULATED = {"avx512": "emu512"}


class IsaError(ValueError):
    """FREETOKEN_CPU_ISA names no path, or one this CPU cannot run or emulate."""


def forced(supported: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """The path FREETOKEN_CPU_ISA forces on a CPU that runs ``supported`` (best first); None
    when it is unset or "auto"."""
    value = (os.environ if env is None else env).get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in CHOICES:
        raise IsaError(f"{ENV}={value!r}: choose one of {', '.join(CHOICES)}")
    if value in supported or value == "scalar":
        return value
    if value in _EMULATED:
        return _EMULATED[value]
    raise IsaError(f"{ENV}={value}: this CPU runs only {', '.join(supported)}")


def detected() -> list[str]:
    """The paths this CPU runs, best first, as the native extensions detect them (both link the
    same detection); [] when they are not built."""
    try:  # deferred: ftnative (the optional C++ extension, absent where the build was skipped)
        import ftnative  # type: ignore[import-not-found]
    except ImportError:
        return []
    return list(ftnative.supported_isas())


def resolve(
    isa: str, supported: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> str:
    """``isa`` as the native kernels should be asked for it: "auto" becomes the path the
    environment forces, if it forces one; any other value is returned unchanged."""
    if isa != "auto":
        return isa
    return forced(detected() if supported is None else supported, env) or "auto"

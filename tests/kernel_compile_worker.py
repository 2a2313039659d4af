"""Compile one Triton kernel launch for real GPU targets, in its own process (no GPU needed).

Run by tests/test_kernels_compiled.py: reads one launch spec as JSON on stdin
    {"module": "ftkernels.slot_cache", "fn": "_decode_kernel", "signature": {name: type},
     "constexprs": {name: value}, "attrs": [[arg index, [["tt.divisibility", 16]]], ...],
     "options": {"num_warps": 8}, "targets": [75, 86, 89, 90]}
and prints one JSON line per target as soon as it is done (so a later target that hangs does not
hide the earlier results): {"cc", "ok", "error", "seconds", "cpu_seconds", "regs", "stack",
"local", "shared"} (cpu_seconds: this process's and its ptxas's, load-independent); with
"ttir": true in the spec, each row also carries the kernel's Triton IR as text ("ttir"). Registers, stack and local memory come from ``cuobjdump -res-usage`` on the cubin
(the compiled kernel's metadata leaves them empty without a driver); a stack frame or local
memory in a Triton kernel means register spills.
"""

from __future__ import annotations

import importlib
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(cuobjdump()), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    m = RES.search(out)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump output:\n{out}")
    regs, stack, shared, local = (int(g) for g in m.groups())
    return {"regs": regs, "stack": stack, "shared_static": shared, "local": local}


def compile_one(spec: dict, cc: int) -> dict:
    fn = getattr(importlib.import_module(spec["module"]), spec["fn"])
    attrs = {(int(i),): v for i, v in spec["attrs"]}
    src = ASTSource(fn, spec["signature"], spec["constexprs"], attrs)
    started, cpu = time.monotonic(), cpu_seconds()
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=spec["options"])
    res = resources(k.asm["cubin"])
    ir = {"ttir": str(k.asm["ttir"])} if spec.get("ttir") else {}
    return {
        **res,
        **ir,
        "shared": max(int(k.metadata.shared), res["shared_static"]),
        "num_warps": int(k.metadata.num_warps),
        "seconds": round(time.monotonic() - started, 2),
        "cpu_seconds": round(cpu_seconds() - cpu, 2),
    }


def cpu_seconds() -> float:
    return sum(
        r.ru_utime + r.ru_stime
        for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )


def main() -> None:
    spec = json.loads(sys.stdin.read())
    for cc in spec["targets"]:
        try:
            row = {"cc": cc, "ok": True, **compile_one(spec, cc)}
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            msg = "".join(traceback.format_exception_only(type(e), e)).strip()
            row = {"cc": cc, "ok": False, "error": msg[-2000:]}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Builds the C++ extensions (``ftnative``, ``ftdense``) into a folder, for tests/gpu/check.sh.

The two extensions build at the same time, each in its own temporary folder (they share kernel
sources: one folder would have two compilers writing the same object file), and each compiles
its sources on every core (setup.py's ParallelCompile; ``FT_BUILD_JOBS=N`` caps it). The wall
time is then about that of the slowest source, a pybind11 bindings file, instead of the sum of
the two extensions' builds in turn (``pip install .`` builds them one after the other). The same
build descriptions as setup.py (native/build.py, native/dense_build.py), the interpreter's own
compiler flags; the Python packages are not copied (check.sh links them).

    python tests/gpu/build_native.py LIB_DIR TEMP_DIR
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(ext: object, lib: Path, temp: Path) -> float:
    from setuptools import Distribution

    t0 = time.perf_counter()
    dist = Distribution({"name": "freetoken", "ext_modules": [ext]})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(lib)
    cmd.build_temp = str(temp / ext.name)  # type: ignore[attr-defined]
    cmd.inplace = False
    cmd.ensure_finalized()
    cmd.run()
    return time.perf_counter() - t0


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    lib, temp = (Path(a).resolve() for a in sys.argv[1:])
    os.chdir(ROOT)  # the build descriptions give sources relative to the project root
    sys.path.insert(0, str(ROOT))
    from pybind11.setup_helpers import ParallelCompile

    from native.build import extensions  # type: ignore[import-not-found]

    ParallelCompile("FT_BUILD_JOBS", default=0).install()
    exts = extensions()
    jobs = os.environ.get("FT_BUILD_JOBS") or os.cpu_count()
    print(", ".join(f"{e.name} ({len(e.sources)} sources)" for e in exts)
          + f": at once, {jobs} compiles each", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(exts)) as pool:
        futures = {pool.submit(build, e, lib, temp): e.name for e in exts}
        for f in as_completed(futures):
            print(f"built {futures[f]} in {f.result():.1f} s", flush=True)
    print(f"VERDICT: {', '.join(futures.values())} built in {time.perf_counter() - t0:.1f} s "
          f"({os.cpu_count()} cores)")  # fmt: skip


if __name__ == "__main__":
    main()

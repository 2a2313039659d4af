"""Package layout: the import names differ from the folder names (DESIGN §6).

`freetokend` lives in `daemon/`, `ftctl` in `ctl/`, `ftkernels` in `kernels/`; the native CPU
executor (`ftnative`) is built from `native/` by `native/build.py` when that folder provides one.
"""

import os
import sys

from setuptools import find_packages, setup

# build_meta does not put the project root on sys.path; native/build.py lives there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_ROOTS = {"freetokend": "daemon", "ftctl": "ctl", "ftkernels": "kernels"}


def _packages() -> list[str]:
    out: list[str] = []
    for name, folder in _ROOTS.items():
        out.append(name)
        out.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return out


def _ext_modules() -> list:
    try:
        from native.build import extensions  # type: ignore[import-not-found]
    except ImportError:
        return []
    # The C++ sources compile one by one by default (minutes on 2 cores, over tests/gpu/check.sh's
    # build limit under load); pybind11's helper compiles them on every core. FT_BUILD_JOBS=N
    # caps the count.
    from pybind11.setup_helpers import ParallelCompile

    ParallelCompile("FT_BUILD_JOBS", default=0).install()
    return extensions()


setup(
    packages=_packages(),
    package_dir=dict(_ROOTS),
    package_data={"freetokend": ["py.typed"], "ftctl": ["py.typed"]},
    ext_modules=_ext_modules(),
)

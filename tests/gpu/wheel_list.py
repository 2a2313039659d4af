"""Print the distributions tests/gpu/check.sh needs on a bare GPU image, one `name==version` a
line, pinned to the versions installed where this runs (what our CI tests with).

The image brings Python 3.12 with CUDA torch, Triton, numpy, grpcio and tokenizers: their
dependency closure is left out, so the wheels stay small (no torch, no nvidia-* wheels).
Usage: python tests/gpu/wheel_list.py [PYTHON_VERSION]   (default 3.12, for markers)
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# what the daemon imports, what the GPU tests import, and what builds the native extensions
NEEDED = [
    "safetensors", "jinja2", "msgspec", "rich", "litestar", "uvicorn", "structlog", "xgrammar",
    "sqlite-utils", "protobuf", "nvidia-ml-py",
    "pytest", "hypothesis", "transformers",
    "setuptools", "wheel", "pybind11",
]  # fmt: skip
IMAGE = ["torch", "triton", "numpy", "grpcio", "tokenizers"]
# the image's may be older than pyproject's build requirement (torch pulls some setuptools)
ALWAYS = ["setuptools"]


def closure(roots: list[str], env: dict[str, str], stop: set[str]) -> dict[str, str | None]:
    """name -> installed version (None when not installed here) of roots and their deps."""
    out: dict[str, str | None] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in out or name in stop:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out[name] = None
            continue
        out[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                todo.append(canonicalize_name(req.name))
    return out


def main() -> None:
    pyver = sys.argv[1] if len(sys.argv) > 1 else "3.12"
    env = {
        "python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython",
    }  # fmt: skip
    image = set(closure(IMAGE, env, set())) - set(ALWAYS) | {"pip"}  # the image has pip
    for name, version in sorted(closure(NEEDED, env, image).items()):
        print(name if version is None else f"{name}=={version}")


if __name__ == "__main__":
    main()

"""The installed versions against pyproject.toml's bounds, for tests/gpu/check.sh's env step.

On a GPU image everything installs ``--no-deps`` over the image's own packages (CUDA torch,
Triton, numpy, grpcio, tokenizers): no resolver ever compares the two, and a mismatch shows up
later as an import error (transformers refuses a tokenizers outside its range; the generated
gRPC stubs refuse an older grpcio) or as an AttributeError deep in a kernel (``triton.knobs``).
This fails in a second instead, naming each one. The bounds are read from pyproject.toml, the
one place they are written:
  - every requirement of [project].dependencies, the ``test`` extra and [build-system].requires
    against the installed version (the interpreter against requires-python). The distributions
    the GPU checks need (tests/gpu/wheel_list.py's NEEDED and IMAGE) must be installed; the
    others are checked where installed;
  - the declared requirements of each of those installed without a resolver (all but the
    image's, whose builder resolved them together) against what is installed: transformers'
    tokenizers range, grpcio-tools' grpcio. A missing one is listed, not failed (the wheels'
    closure brings what an import needs; the import step finds the rest).
Prints one line a distribution, then a ``VERDICT:`` line; exits 1 on a mismatch, else 0.

Usage: python tests/gpu/env_check.py [--pyproject PATH] [--wheel-list PATH]
"""

from __future__ import annotations

import argparse
import ast
import platform
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
except ImportError:  # the wheels not installed yet: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef,assignment]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef,assignment]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef,assignment]

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("dependencies", "test extra", "build-system")

Version = Callable[[str], "str | None"]  # distribution -> installed version (None: absent)
Requires = Callable[[str], "list[str]"]  # distribution -> its declared requirements


@dataclass(frozen=True)
class Line:
    """One verdict: ``status`` FAIL (a mismatch), ok, or note (absent where not needed)."""

    status: str
    text: str

    def __str__(self) -> str:
        return f"{self.status:<5} {self.text}"


def read_bounds(pyproject: Path) -> dict[str, list[Requirement]]:
    """pyproject's requirements by group (``GROUPS``), and requires-python under "python"."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data["project"]
    out = {
        "dependencies": project.get("dependencies", []),
        "test extra": project.get("optional-dependencies", {}).get("test", []),
        "build-system": data.get("build-system", {}).get("requires", []),
    }
    reqs = {group: [Requirement(r) for r in specs] for group, specs in out.items()}
    reqs["python"] = [Requirement("python" + project.get("requires-python", ""))]
    return reqs


def read_gpu_lists(wheel_list: Path) -> tuple[set[str], set[str]]:
    """(needed, image): wheel_list.py's NEEDED + IMAGE and IMAGE, read from its source (it is
    not imported: it needs ``packaging``, which the wheels may not have brought yet)."""
    lists: dict[str, list[str]] = {}
    for node in ast.parse(wheel_list.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("NEEDED", "IMAGE"):
                lists[target.id] = ast.literal_eval(node.value)
    image = {str(canonicalize_name(n)) for n in lists.get("IMAGE", [])}
    return {str(canonicalize_name(n)) for n in lists.get("NEEDED", [])} | image, image


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` that imports find first (None: not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def declared_requires(name: str) -> list[str]:
    """Distribution ``name``'s Requires-Dist lines."""
    try:
        return metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return []


def _admits(spec: SpecifierSet, version: str) -> bool:
    # pre-releases and local builds (torch 2.13.0+cu130, nightlies) are judged by their value
    return spec.contains(version, prereleases=True)


def _applies(req: Requirement) -> bool:
    """Whether ``req`` applies here: no marker, or one this interpreter meets (no extra)."""
    return req.marker is None or req.marker.evaluate({"extra": ""})


def check_bounds(
    bounds: dict[str, list[Requirement]], needed: set[str], version: Version
) -> list[Line]:
    """pyproject's own bounds against the installed versions."""
    out = []
    py = platform.python_version()
    spec = bounds["python"][0].specifier
    status = "ok" if _admits(spec, py) else "FAIL"
    out.append(Line(status, f"python {py} (requires-python {spec or 'any'})"))
    seen: set[str] = set()
    for group in GROUPS:
        for req in bounds.get(group, []):
            name = canonicalize_name(req.name)
            if name in seen or not _applies(req):
                continue
            seen.add(name)
            got = version(req.name)
            if got is None:
                status = "FAIL" if name in needed else "note"
                why = "needed by the GPU checks" if name in needed else "not needed here"
                out.append(Line(status, f"{req.name}: not installed ({why}; {group}: {req})"))
            elif not _admits(req.specifier, got):
                out.append(Line("FAIL", f"{req.name} {got}: pyproject's {group} wants {req}"))
            else:
                out.append(Line("ok", f"{req.name} {got} ({req})"))
    return out


def check_dependents(
    names: Iterable[str], image: set[str], version: Version, requires: Requires
) -> list[Line]:
    """The declared requirements of installed distributions ``names`` (all but the image's)
    against what is installed: the checks a resolver would have made."""
    out = []
    for name in names:
        own = version(name)
        if own is None or canonicalize_name(name) in image:
            continue
        for spec in requires(name):
            req = Requirement(spec)
            if not _applies(req):
                continue
            got = version(req.name)
            if got is None:
                out.append(Line("note", f"{req.name}: not installed ({name} {own} requires {req})"))
            elif not _admits(req.specifier, got):
                out.append(Line("FAIL", f"{req.name} {got}: {name} {own} requires {req}"))
    return out


def run(
    pyproject: Path,
    wheel_list: Path,
    version: Version = installed_version,
    requires: Requires = declared_requires,
) -> list[Line]:
    """Every line of the check (``check_bounds``, then ``check_dependents``)."""
    bounds = read_bounds(pyproject)
    needed, image = read_gpu_lists(wheel_list)
    names = [r.name for g in GROUPS for r in bounds.get(g, []) if _applies(r)]
    return check_bounds(bounds, needed, version) + check_dependents(
        dict.fromkeys(names), image, version, requires
    )


def main(argv: list[str] | None = None) -> int:
    """Prints the lines and the verdict; 1 on a mismatch."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    ap.add_argument("--wheel-list", type=Path, default=ROOT / "tests/gpu/wheel_list.py")
    args = ap.parse_args(argv)
    lines = run(args.pyproject, args.wheel_list)
    for line in lines:
        print(line)
    bad = [line.text for line in lines if line.status == "FAIL"]
    checked = sum(line.status == "ok" for line in lines)
    if bad:
        print(f"VERDICT: {len(bad)} version mismatch(es): " + "; ".join(bad))
        return 1
    print(f"VERDICT: {checked} versions within pyproject's bounds and their dependents' ranges")
    return 0


if __name__ == "__main__":
    sys.exit(main())

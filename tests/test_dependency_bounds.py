"""pyproject.toml's version bounds admit only what the code needs, and tests/gpu/env_check.py
(check.sh's env step on a GPU image, where everything installs ``--no-deps`` over the image's
packages) reads them and fails on a mismatch (issue 40).

The bounds follow the code: ``triton.knobs`` (Triton 3.4+) in the kernels, the gRPC and protobuf
versions the generated admin stubs check at import, and the tokenizers and safetensors ranges
transformers checks at import (its floor, 5.18, needs them as the installed one does).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _env_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("env_check", ROOT / "tests/gpu/env_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def bound(name: str, pyproject: Path = PYPROJECT) -> SpecifierSet:
    """pyproject's specifier of distribution ``name`` (dependencies or the test extra)."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    specs = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    for spec in specs:
        req = Requirement(spec)
        if canonicalize_name(req.name) == canonicalize_name(name):
            return req.specifier
    raise AssertionError(f"{name} is not in pyproject.toml")


def floor(spec: SpecifierSet) -> str:
    """The lowest version ``spec`` admits (its >= bound)."""
    lows = [s.version for s in spec if s.operator == ">="]
    assert len(lows) == 1, spec
    return lows[0]


def _uses_attribute(folder: Path, dotted: str) -> list[str]:
    """The files under ``folder`` that read attribute chain ``dotted`` (e.g. triton.knobs)."""
    base, attr = dotted.rsplit(".", 1)
    hits = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == attr
                and ast.unparse(node.value) == base
            ):
                hits.append(str(path.relative_to(ROOT)))
                break
    return hits


def test_triton_bound_admits_no_triton_without_knobs(pyproject: Path = PYPROJECT) -> None:
    assert _uses_attribute(ROOT / "kernels", "triton.knobs")  # the need (Triton 3.4+)
    spec = bound("triton", pyproject)
    assert not spec.contains("3.3.1") and spec.contains("3.4.0"), spec


def test_grpc_and_protobuf_floors_meet_the_generated_stubs(pyproject: Path = PYPROJECT) -> None:
    grpc_src = (ROOT / "daemon/admin/admin_pb2_grpc.py").read_text(encoding="utf-8")
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_src)
    assert generated is not None
    assert floor(bound("grpcio", pyproject)) == generated.group(1)
    pb_src = (ROOT / "daemon/admin/admin_pb2.py").read_text(encoding="utf-8")
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb_src)
    assert gencode is not None
    spec = bound("protobuf", pyproject)
    assert floor(spec) == ".".join(gencode.groups()) and spec.contains(floor(spec)), spec


@pytest.mark.parametrize("dist", ["tokenizers", "safetensors"])
def test_floors_meet_what_transformers_checks_at_import(
    dist: str, pyproject: Path = PYPROJECT
) -> None:
    """transformers refuses at import a tokenizers or safetensors outside its range: our floor
    must be inside the installed transformers' (5.18's is the same: tokenizers >= 0.23.1,
    safetensors >= 0.8.0)."""
    theirs = [Requirement(r) for r in metadata.requires("transformers") or []]
    (req,) = [r for r in theirs if canonicalize_name(r.name) == dist and r.marker is None]
    ours = floor(bound(dist, pyproject))
    assert req.specifier.contains(ours), f"{dist}>={ours}, transformers wants {req.specifier}"


# ---- env_check ---------------------------------------------------------------------------------
def _write(tmp_path: Path, deps: list[str], needed: list[str], image: list[str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nrequires-python = ">=3.11"\n'
        f"dependencies = {deps!r}\n"  # a list of single-quoted (literal) TOML strings
        '[project.optional-dependencies]\ntest = ["triton>=3.4"]\n'
        '[build-system]\nrequires = ["setuptools>=77"]\n'
    )
    (tmp_path / "wheel_list.py").write_text(f"NEEDED = {needed!r}\nIMAGE = {image!r}\n")
    return tmp_path


def test_env_check_names_each_mismatch(tmp_path: Path) -> None:
    ec = _env_check()
    d = _write(
        tmp_path, ["tokenizers>=0.23.1", "transformers>=5.18", "gguf>=0.17", "grpcio>=1.85.1"],
        needed=["transformers"], image=["tokenizers", "grpcio", "triton"],
    )  # fmt: skip
    installed = {
        "tokenizers": "0.22.1", "transformers": "5.25.0", "triton": "3.3.1",
        "setuptools": "80.0", "packaging": "24.0",
    }  # fmt: skip
    requires = {
        "transformers": ["tokenizers<0.24.0,>=0.23.1", "packaging>=20.0", "typer",
                         'pytest; extra == "testing"'],
        "tokenizers": ["huggingface-hub<0.5"],  # the image's own: its builder resolved them
    }  # fmt: skip
    lines = ec.run(d / "pyproject.toml", d / "wheel_list.py", installed.get,
                   lambda n: requires.get(n, []))  # fmt: skip
    text = {str(line) for line in lines}
    assert "FAIL  tokenizers 0.22.1: pyproject's dependencies wants tokenizers>=0.23.1" in text
    assert "FAIL  tokenizers 0.22.1: transformers 5.25.0 requires tokenizers<0.24.0,>=0.23.1" in (
        text
    )
    assert "FAIL  triton 3.3.1: pyproject's test extra wants triton>=3.4" in text
    assert any(t.startswith("FAIL  grpcio: not installed (needed") for t in text)  # image's
    assert any(t.startswith("note  gguf: not installed (not needed") for t in text)
    assert "note  typer: not installed (transformers 5.25.0 requires typer)" in text
    assert "ok    transformers 5.25.0 (transformers>=5.18)" in text
    assert not any("huggingface-hub" in t or "pytest" in t for t in text)


def test_env_check_exits_nonzero_on_a_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ec = _env_check()
    numpy = metadata.version("numpy")
    ok = _write(tmp_path, [f"numpy>={numpy}"], needed=["numpy"], image=["numpy"])
    args = ["--pyproject", str(ok / "pyproject.toml"), "--wheel-list", str(ok / "wheel_list.py")]
    assert ec.main(args) == 0
    assert "VERDICT: " in capsys.readouterr().out
    _write(tmp_path, ["numpy>=999"], needed=["numpy"], image=["numpy"])
    assert ec.main(args) == 1
    out = capsys.readouterr().out
    assert f"VERDICT: 1 version mismatch(es): numpy {numpy}: pyproject's" in out


def test_env_check_reads_this_checkouts_bounds() -> None:
    """The real files parse: every pyproject requirement is checked, the GPU lists are read."""
    ec = _env_check()
    bounds = ec.read_bounds(PYPROJECT)
    needed, image = ec.read_gpu_lists(ROOT / "tests/gpu/wheel_list.py")
    assert {"torch", "triton", "tokenizers", "grpcio", "numpy"} <= image <= needed
    assert "transformers" in needed
    names = {canonicalize_name(r.name) for g in ec.GROUPS for r in bounds[g]}
    assert needed <= names | image, needed - names

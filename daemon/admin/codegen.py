"""Regenerate admin_pb2.py, admin_pb2.pyi and admin_pb2_grpc.py from admin.proto.

Run after editing the proto: ``python -m freetokend.admin.codegen`` (needs grpcio-tools, a
build-time tool only: the generated files are committed, so installs need no codegen).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    # deferred: grpc_tools (only code generation needs it)
    from grpc_tools import protoc

    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={HERE}",
            f"--pyi_out={HERE}",
            f"--grpc_python_out={HERE}",
            str(HERE / "admin.proto"),
        ]
    )
    if rc != 0:
        return int(rc)
    # protoc writes a top-level import; the module lives in a package.
    grpc_file = HERE / "admin_pb2_grpc.py"
    text = grpc_file.read_text(encoding="utf-8")
    grpc_file.write_text(
        re.sub(r"^import admin_pb2 as", "from . import admin_pb2 as", text, flags=re.M),
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

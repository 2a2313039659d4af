"""The admin client: one gRPC channel to the daemon's unix socket, errors as one-line CtlError."""

from __future__ import annotations

import grp
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from freetokend.admin import admin_pb2 as pb
from freetokend.admin import admin_pb2_grpc as pb_grpc
from freetokend.admin.paths import UntrustedSocket, check_trusted, client_socket


class CtlError(Exception):
    """What went wrong, in one line; ftctl prints it and exits non-zero."""


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class AdminClient:
    def __init__(self, socket: str | None = None, timeout: float = 30.0) -> None:
        self.path: Path = client_socket(socket)
        self.timeout = timeout
        if not self.path.exists():
            raise CtlError(
                f"no daemon listening at {self.path} (is freetokend running? --socket PATH)"
            )
        try:
            check_trusted(self.path)
        except UntrustedSocket as e:
            raise CtlError(str(e)) from None
        if not os.access(self.path, os.R_OK | os.W_OK):
            group = _group_name(self.path.stat().st_gid)
            raise CtlError(f"permission denied on {self.path}: join the group {group!r}")
        self._channel = grpc.insecure_channel(f"unix:{self.path}")
        self._stub = pb_grpc.AdminStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, e: grpc.RpcError) -> CtlError:
        code = e.code() if hasattr(e, "code") else None
        details = (e.details() if hasattr(e, "details") else "") or ""
        if code is grpc.StatusCode.UNAVAILABLE:
            return CtlError(
                f"cannot talk to the daemon at {self.path} (not running, or it refused this "
                f"user: the socket's owner, root and its group are allowed)"
            )
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return CtlError(f"the daemon did not answer within {self.timeout:g} s")
        return CtlError(" ".join(details.split()) or str(code))

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def stream(self, method: str, request: Any, timeout: float | None = None) -> Iterator[Any]:
        """Progress messages of a long operation (no deadline unless ``timeout``)."""
        try:
            yield from getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None


def to_dict(msg: Any) -> dict[str, Any]:
    """A message as plain JSON-able data: every field present, int64 as numbers, an unset
    sub-message as None."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None:
            if field.is_repeated:
                out[field.name] = [to_dict(v) for v in value]
            else:
                out[field.name] = to_dict(value) if msg.HasField(field.name) else None
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


__all__ = ["AdminClient", "CtlError", "pb", "to_dict"]

"""The admin socket: peer-credential policy, a foreign uid refused at the gate, gRPC through it,
socket path rules, sd_notify."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from freetokend.admin import admin_pb2 as pb
from freetokend.admin import admin_pb2_grpc as pb_grpc
from freetokend.admin.gate import SocketBusy, claim_path
from freetokend.admin.paths import client_socket, daemon_socket, user_socket
from freetokend.admin.peercred import AccessPolicy, PeerCred, peer_credentials
from freetokend.admin.server import AdminServer
from freetokend.runtime.sdnotify import notify

NOBODY = 65534


class FakeOps:
    """Just enough control plane for Status."""

    def status(self) -> dict[str, Any]:
        return {"version": "test", "pid": os.getpid(), "active_model": "m"}


@pytest.fixture()
def short_dir():  # type: ignore[no-untyped-def]
    d = Path(tempfile.mkdtemp(prefix="fta-", dir="/tmp"))  # unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_policy() -> None:
    pol = AccessPolicy(uid=1000, gid=1001)
    assert pol.allows(PeerCred(1, 1000, 5))  # the daemon's own user
    assert pol.allows(PeerCred(1, 0, 0))  # root
    assert pol.allows(PeerCred(1, 2000, 1001))  # primary group = the socket's
    assert pol.allows(PeerCred(1, 2000, 5), frozenset({7, 1001}))  # supplementary group
    assert not pol.allows(PeerCred(1, 2000, 5), frozenset({7}))
    assert not pol.allows(PeerCred(1, NOBODY, NOBODY))


def test_peer_credentials_of_a_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        cred = peer_credentials(a)
        assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.getuid(), os.getgid())
        ok, _ = AccessPolicy(os.getuid(), os.getgid()).check(a)
        assert ok


def _connect_as(uid: int, path: Path) -> bytes:
    """Fork a child that drops to ``uid`` and speaks to ``path``; returns what it read back
    (b"" when the server closed the connection), or b"connect-failed"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no Python-level cleanup, no pytest machinery
        os.close(r)
        out = b"connect-failed"
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(60)
            s.connect(str(path))
            out = b""
            # an HTTP/2 client preface: a gRPC server answers with a SETTINGS frame
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
            out = s.recv(64)
        except (ConnectionResetError, BrokenPipeError):
            out = b""  # closed by the server
        except OSError:
            pass
        os.write(w, out or b"<closed>")
        os._exit(0)
    os.close(w)
    data = os.read(r, 256)
    os.close(r)
    os.waitpid(pid, 0)
    return data


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to setuid() to nobody")
def test_foreign_uid_is_refused_at_the_gate(short_dir: Path) -> None:
    path = short_dir / "admin.sock"
    server = AdminServer(FakeOps(), path)  # type: ignore[arg-type]
    server.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        # open the file system's door so only the credential check stands in the way
        os.chmod(short_dir, 0o755)
        os.chmod(path, 0o666)
        assert _connect_as(NOBODY, path) == b"<closed>"
        assert server.gate is not None and server.gate.refused == 1
        # root (allowed) gets HTTP/2 frames back from the gRPC server through the gate
        assert _connect_as(0, path) not in (b"<closed>", b"connect-failed")
        with grpc.insecure_channel(f"unix:{path}") as ch:
            reply = pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=60)
        assert (reply.version, reply.active_model, reply.pid) == ("test", "m", os.getpid())
        assert server.gate.refused == 1
    finally:
        server.stop()
    assert not path.exists() and not list(short_dir.glob(".admin-*"))


def test_busy_and_stale_socket_paths(short_dir: Path) -> None:
    path = short_dir / "admin.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen()
    with pytest.raises(SocketBusy, match="another daemon"):
        claim_path(path)
    live.close()  # the file stays: a stale socket, removed by the next daemon
    assert path.exists()
    claim_path(path)
    assert not path.exists()
    path.write_text("x")
    with pytest.raises(SocketBusy, match="not a socket"):
        claim_path(path)


def test_socket_paths() -> None:
    assert user_socket({"RUNTIME_DIRECTORY": "/run/freetokend"}) == Path(
        "/run/freetokend/admin.sock"
    )
    assert user_socket({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path(
        "/run/user/7/freetoken/admin.sock"
    )
    assert user_socket({}).name == "admin.sock"
    assert daemon_socket("off", {}) is None
    assert daemon_socket("/x/a.sock", {}) == Path("/x/a.sock")
    assert client_socket("/y.sock", {}) == Path("/y.sock")
    assert client_socket(None, {"FREETOKEN_ADMIN_SOCKET": "/z.sock"}) == Path("/z.sock")


def test_sd_notify(short_dir: Path) -> None:
    path = short_dir / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        assert notify("READY=1", "STATUS=serving m", env={"NOTIFY_SOCKET": str(path)})
        assert s.recv(256) == b"READY=1\nSTATUS=serving m"
    abstract = f"@ft-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + abstract[1:])
        assert notify("STOPPING=1", env={"NOTIFY_SOCKET": abstract})
        assert s.recv(64) == b"STOPPING=1"
    assert not notify("READY=1", env={})


def test_private_folders_of_killed_daemons_are_removed(short_dir: Path) -> None:
    dead = short_dir / ".admin-dead"
    dead.mkdir()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead / "grpc.sock"))  # bound, never listening: what a killed daemon leaves
    s.close()
    first = AdminServer(FakeOps(), short_dir / "a.sock")  # type: ignore[arg-type]
    first.start()
    try:
        assert not dead.exists()
        (live,) = short_dir.glob(".admin-*")
        second = AdminServer(FakeOps(), short_dir / "b.sock")  # type: ignore[arg-type]
        second.start()
        second.stop()
        assert live.exists()  # the first daemon's folder stays
    finally:
        first.stop()
    assert not list(short_dir.glob(".admin-*"))


# ---- ftctl trusts only a socket no other user could have placed (issue 15) -----------------


def _give_away(*paths: Path) -> int:
    """Makes ``paths`` another user's: chown to nobody as root; otherwise this process
    pretends to be someone else (the files stay ours). Returns the uid ftctl runs as."""
    if os.getuid() == 0:
        for p in paths:
            os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
        return 0
    return os.getuid() + 1000


def _listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


def test_check_trusted(short_dir: Path) -> None:
    from freetokend.admin.paths import UntrustedSocket, check_trusted

    own = short_dir / "own"
    own.mkdir(mode=0o700)
    with _listening(own / "admin.sock"):
        check_trusted(own / "admin.sock")  # the caller's private folder
        os.chmod(own, 0o777)
        with pytest.raises(UntrustedSocket, match="can be written by other users"):
            check_trusted(own / "admin.sock")
        os.chmod(own, 0o700)
    (own / "file").write_text("x")
    with pytest.raises(UntrustedSocket, match="not a socket"):
        check_trusted(own / "file")

    # shared place (sticky, world-writable, like /tmp): another user's folder is refused
    os.chmod(short_dir, 0o1777)
    theirs = short_dir / "theirs"
    theirs.mkdir(mode=0o755)
    with _listening(theirs / "admin.sock"):
        uid = _give_away(theirs, theirs / "admin.sock")
        with pytest.raises(UntrustedSocket, match="belongs to") as e:
            check_trusted(theirs / "admin.sock", uid=uid)
        assert "--socket" in str(e.value) and str(theirs) in str(e.value)
        # the same folder under a parent only root writes (systemd's /run/freetokend, owned
        # by the service user): root made it, so it is trusted
        if os.getuid() == 0:
            os.chmod(short_dir, 0o755)
            check_trusted(theirs / "admin.sock", uid=uid)


def test_ftctl_refuses_a_socket_planted_in_tmp(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without XDG_RUNTIME_DIR, ftctl looks in /tmp/freetoken-UID; another user created that
    folder first and runs an admin server in it (here: a real one answering Status)."""
    from ftctl.main import main

    for name in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", "FREETOKEN_ADMIN_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir))  # short_dir plays /tmp
    os.chmod(short_dir, 0o1777)
    caller = os.getuid() if os.getuid() == 0 else os.getuid() + 1000
    path = short_dir / f"freetoken-{caller}" / "admin.sock"
    server = AdminServer(FakeOps(), path)  # type: ignore[arg-type]
    server.start()
    try:
        os.chmod(path.parent, 0o755)
        os.chmod(path, 0o666)
        assert _give_away(path.parent, path) == caller
        monkeypatch.setattr(os, "getuid", lambda: caller)  # (as root: no change)
        assert user_socket({}) == path
        rc = main(["--json", "status"])
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert rc == 1, "ftctl talked to another user's socket"
    assert err.startswith(f"ftctl: refusing the admin socket {path}") and "belongs to" in err


def test_socket_folder_is_private_whatever_the_umask(short_dir: Path) -> None:
    path = short_dir / "fresh" / "admin.sock"
    old = os.umask(0)
    server = AdminServer(FakeOps(), path)  # type: ignore[arg-type]
    try:
        server.start()
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        (private,) = path.parent.glob(".admin-*")  # the gRPC server's own socket
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        os.umask(old)
        server.stop()

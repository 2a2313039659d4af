"""The SQLite state store: typed tables, WAL durability under kill -9, migrations, and clear
errors for foreign or damaged files."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from freetokend.runtime.bandwidth import BandwidthProfile
from freetokend.store import AnchorRecord, BandwidthRow, RequestEntry, Store, StoreError
from freetokend.store.db import APP_ID
from freetokend.store.schema import MIGRATIONS

LATEST = len(MIGRATIONS)


def _entry(i: int) -> RequestEntry:
    return RequestEntry(float(i), "m", "/v1/chat/completions", 100 + i, i, 5, "stop", 1.5, 20.0)


def test_fresh_store_is_ours_in_wal_mode_at_the_latest_schema(tmp_path):
    with Store(tmp_path) as s:
        assert s.version == LATEST
    conn = sqlite3.connect(tmp_path / "state.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APP_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST
    assert [
        r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY version")
    ] == list(range(1, LATEST + 1))


def test_bandwidth_latest_profile_per_host_gpu_and_format(tmp_path):
    with Store(tmp_path) as s:
        s.save_bandwidth_row(BandwidthRow(s.host, "cuda:A", "bf16", 10e9, 40e9, 100.0))
        s.save_bandwidth_row(BandwidthRow(s.host, "cuda:A", "bf16", 12e9, 41e9, 200.0))
        s.save_bandwidth_row(BandwidthRow(s.host, "cuda:A", "mxfp4", 9e9, 30e9, 300.0))
        s.save_bandwidth_row(BandwidthRow("other", "cuda:A", "bf16", 1e9, 1e9, 400.0))
        got = s.latest_bandwidth("cuda:A", "bf16")
        assert got is not None and (got.b_p, got.b_h, got.measured_at) == (12e9, 41e9, 200.0)
        assert s.latest_bandwidth("cuda:B", "bf16") is None
        # the control plane's protocol: BandwidthProfile in, BandwidthProfile out
        s.save_bandwidth(BandwidthProfile(11.8e9, 47.5e9, "fp8", "cuda:A", 3 << 20))
        assert s.bandwidth("fp8", "cuda:A") == BandwidthProfile(
            11.8e9, 47.5e9, "fp8", "cuda:A", 3 << 20
        )
        assert s.bandwidth("fp8", "standin") is None
        # with the disk's read rate (B_D), O_DIRECT or not, the file and its note
        disk = BandwidthProfile(
            11.9e9, 47.0e9, "fp8", "cuda:A", 3 << 20, 6.8e9, True, "/m/x.gguf", "the GGUF file"
        )
        s.save_bandwidth(disk)
        assert s.bandwidth("fp8", "cuda:A") == disk
        paged = BandwidthProfile(1.0, 2.0, "fp8", "cuda:A", 3, 9e9, False, "/tmp/x.gguf", "")
        s.save_bandwidth(paged)
        assert s.bandwidth("fp8", "cuda:A") == paged


def test_model_registry_fingerprints_and_recency(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "x"}')
        (d / "model.safetensors").write_bytes(b"\0" * 64)
    with Store(tmp_path / "state") as s:
        s.register_model("alpha", str(a))
        s.register_model("beta", str(b))
        assert s.registered_models() == {"alpha": str(a), "beta": str(b)}
        fp = s.model(str(a)).fingerprint
        s.touch_model(str(a))
        assert [m.name for m in s.models()] == ["alpha", "beta"]  # most recently used first
        (a / "model.safetensors").write_bytes(b"\1" * 65)  # rewritten weights
        s.register_model("alpha", str(a))
        rec = s.model(str(a))
        assert rec is not None and rec.fingerprint != fp and rec.format == "hf"


def test_anchor_metadata_roundtrip(tmp_path):
    rec = AnchorRecord("fp1", "ab" * 16, 812, "tool_output_start", 76800, 10.0, "spill/ab.snap")
    with Store(tmp_path) as s:
        s.put_anchor(rec)
        s.put_anchor(AnchorRecord("fp1", "cd" * 16, 900, "end_of_turn", 76800, 20.0))
        s.put_anchor(AnchorRecord("fp2", "ab" * 16, 5, "end_of_turn", 1, 30.0))
        assert [a.position for a in s.anchors("fp1")] == [900, 812]  # most recent first
        s.touch_anchor("fp1", "ab" * 16)
        assert s.anchors("fp1")[0].prefix_hash == "ab" * 16
        assert s.anchor_bytes("fp1") == 2 * 76800
        s.put_anchor(rec)  # upsert: same key, no duplicate
        assert len(s.anchors("fp1")) == 2
        s.delete_anchor("fp1", "cd" * 16)
        assert [a.spill_path for a in s.anchors("fp1")] == ["spill/ab.snap"]


def test_request_log_is_a_ring(tmp_path):
    with Store(tmp_path, request_log_rows=5) as s:
        for i in range(12):
            s.log_request(_entry(i))
        got = s.recent_requests(100)
        assert [e.prompt_tokens for e in got] == [111, 110, 109, 108, 107]
        assert got[0] == _entry(11)


def test_transaction_is_all_or_nothing_and_threads_share_the_store(tmp_path):
    with Store(tmp_path) as s:
        with pytest.raises(RuntimeError), s.transaction():
            s.log_request(_entry(1))
            s.put_anchor(AnchorRecord("fp", "00", 1, "end_of_turn", 1, 1.0))
            raise RuntimeError("boom")
        assert s.recent_requests() == [] and s.anchors("fp") == []
        threads = [
            threading.Thread(target=lambda: [s.log_request(_entry(i)) for i in range(50)])
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(s.recent_requests(1000)) == 200


_WRITER = textwrap.dedent(
    """
    import sys
    from freetokend.store import AnchorRecord, RequestEntry, Store
    s = Store(sys.argv[1], request_log_rows=10**6)
    i = 0
    while True:
        with s.transaction():  # two rows per commit: a torn commit would show as a lone row
            s.log_request(RequestEntry(float(i), "m", "/v1/x", i, 0, 0, "stop"))
            s.put_anchor(AnchorRecord("fp", f"{i:08x}", i, "end_of_turn", 1, float(i)))
        print(i, flush=True)  # acknowledged only after the commit returned
        i += 1
    """
)


def test_kill_9_during_writes_loses_nothing_committed(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    assert proc.stdout is not None
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)  # mid-stream: it keeps committing until the signal lands
    proc.wait()
    with Store(tmp_path) as s:
        logged = {e.prompt_tokens for e in s.recent_requests(10**6)}
        anchored = {a.position for a in s.anchors("fp")}
    assert set(range(acked + 1)) <= logged  # every acknowledged commit is there
    assert logged == anchored  # and no commit is torn
    assert logged == set(range(len(logged)))


def test_migrates_an_older_store_keeping_its_data(tmp_path):
    with Store(tmp_path, _upto=1) as old:
        assert old.version == 1
        tables = old._db.table_names()
        assert "anchors" not in tables and "request_log" not in tables
        old._db.execute(  # the v1 table's columns (BandwidthRow now has more)
            "INSERT INTO bandwidth_profiles (host, gpu, format, b_p, b_h, measured_at)"
            " VALUES (?, 'cuda:A', 'bf16', 1.0, 2.0, 3.0)",
            (old.host,),
        )
        old._db.conn.commit()
        old.register_model("m", str(tmp_path))
    with Store(tmp_path) as s:
        assert s.version == LATEST
        assert s.latest_bandwidth("cuda:A", "bf16") == BandwidthRow(
            s.host, "cuda:A", "bf16", 1.0, 2.0, 3.0
        )
        assert s.registered_models() == {"m": str(tmp_path)}
        s.put_anchor(AnchorRecord("fp", "00", 1, "end_of_turn", 1, 1.0))  # the new tables work
        s.log_request(_entry(0))


def test_a_v2_store_reads_its_profiles_with_the_disk_rate_not_measured(tmp_path):
    """v3 adds B_D (and how it was read) to the bandwidth profiles: a store written before it
    opens, its profiles read with b_d 0 (not measured), and new ones keep the disk rate."""
    with Store(tmp_path, _upto=2) as old:
        assert old.version == 2
        columns = {c.name for c in old._db.table("bandwidth_profiles").columns}
        assert "b_d" not in columns and "disk_direct" not in columns
        old._db.execute(
            "INSERT INTO bandwidth_profiles (host, gpu, format, b_p, b_h, measured_at, expert_bytes)"
            " VALUES (?, 'standin', 'q4_k', 5e9, 7e9, 3.0, 4096)",
            (old.host,),
        )
        old._db.conn.commit()
    with Store(tmp_path) as s:
        assert s.version == LATEST >= 3
        assert s.bandwidth("q4_k", "standin") == BandwidthProfile(5e9, 7e9, "q4_k", "standin", 4096)
        got = s.bandwidth("q4_k", "standin")
        assert got is not None and got.b_d == 0.0 and not got.disk_direct and got.disk_path == ""
        new = BandwidthProfile(5e9, 7e9, "q4_k", "standin", 4096, 7e8, True, "/m/a.gguf", "")
        s.save_bandwidth(new)
        assert s.bandwidth("q4_k", "standin") == new


def test_store_of_a_newer_freetoken_is_refused(tmp_path):
    Store(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute("INSERT INTO schema_version VALUES (99, 'future', 0)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer freetoken"):
        Store(tmp_path)


def test_foreign_sqlite_database_is_refused_and_left_alone(tmp_path):
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.execute("INSERT INTO users VALUES ('x')")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match="another program"):
        Store(tmp_path)
    assert db.read_bytes() == before


def test_non_sqlite_file_is_refused(tmp_path):
    (tmp_path / "state.db").write_bytes(b"this is not a database\n" * 100)
    with pytest.raises(StoreError, match="not an SQLite database"):
        Store(tmp_path)


def _damage(path: Path) -> None:
    """Overwrites the middle of the file (table b-tree pages) with garbage."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        f.write(b"\xa5" * 8192)


def test_damaged_store_is_refused_with_a_clear_error(tmp_path):
    with Store(tmp_path, request_log_rows=10**6) as s:
        with s.transaction():
            for i in range(3000):
                s.log_request(_entry(i))
    _damage(tmp_path / "state.db")
    with pytest.raises(StoreError, match="damaged"):
        Store(tmp_path)


def test_cli_reports_a_bad_file_in_one_line_without_a_traceback(tmp_path):
    (tmp_path / "state.db").write_bytes(b"\x00garbage" * 64)
    run = subprocess.run(
        [sys.executable, "-m", "freetokend.store", str(tmp_path)], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    ok = subprocess.run(
        [sys.executable, "-m", "freetokend.store", str(tmp_path / "new")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and f"schema version {LATEST}" in ok.stdout


def test_state_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    """Issue 15: with umask 0 (or the login's 022) the state folder, the database and its WAL
    came out world-readable; a database an older version left 0644 is tightened too."""
    import stat

    old = os.umask(0)
    try:
        state = tmp_path / "a" / "state"
        with Store(state) as store:
            store.register_model("m", str(tmp_path))
            assert (state / "state.db-wal").exists()  # open: the WAL holds the write
            for name in ("state.db", "state.db-wal", "state.db-shm"):
                assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        os.chmod(state / "state.db", 0o644)
        os.chmod(state, 0o777)
        with Store(state):
            pass
        assert stat.S_IMODE((state / "state.db").stat().st_mode) == 0o600
        assert stat.S_IMODE(state.stat().st_mode) & 0o027 == 0
    finally:
        os.umask(old)


def test_a_second_store_in_a_process_keeps_the_first_ones_wal(tmp_path):
    """CI failure of session 4: the daemon opens a store for its control plane and one per loaded
    model. Opening the second used to read the file's header from Python, and closing that file
    dropped the POSIX locks of the first connection; a daemon or ftctl that then closed its own
    connection took itself for the last one, checkpointed and deleted the WAL under ours: later
    commits went to a deleted file (lost for every other process) and the file came out
    "malformed"."""
    first = Store(tmp_path)
    first.register(_model_record("/m/0"))
    second = Store(tmp_path)
    other = textwrap.dedent(
        f"""
        from freetokend.store import Store
        s = Store({str(tmp_path)!r})
        s.log_request(__import__("freetokend.store", fromlist=["RequestEntry"]).RequestEntry(
            0.0, "m", "/v1/chat/completions", 1, 1, 1, "stop", 1.0, 1.0))
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", other], check=True)
    assert (tmp_path / "state.db-wal").exists(), "another process deleted our open WAL"
    for i in range(1, 50):
        first.register(_model_record(f"/m/{i}"))
    with Store(tmp_path) as fresh:  # a new connection sees every commit of the first
        assert len(fresh.models()) == 50
    out = subprocess.run(
        [sys.executable, "-m", "freetokend.store", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "models: 50" in out.stdout, out.stdout + out.stderr
    second.close()
    first.close()


def _model_record(path: str):  # type: ignore[no-untyped-def]
    from freetokend.store.models import ModelRecord

    return ModelRecord(path, "m", "hf", "fp", 0.0)


def test_stores_opened_together_on_a_fresh_folder_all_work(tmp_path):
    """Two daemons, or the daemon and ftctl, starting at once on a new state folder: each open
    migrates and writes; deferred transactions failed at once with "database is locked" (a read
    snapshot cannot be upgraded once another connection committed) or re-ran a migration
    another connection had just applied ("table schema_version already exists")."""
    errors: list[BaseException] = []

    def open_and_write(folder: Path, i: int) -> None:
        try:
            with Store(folder) as s:
                s.register(_model_record(f"/m/{i}"))
                s.log_request(_entry(i))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    for trial in range(8):
        folder = tmp_path / str(trial)
        threads = [threading.Thread(target=open_and_write, args=(folder, i)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        with Store(folder) as s:
            assert s.version == LATEST and len(s.models()) == 6

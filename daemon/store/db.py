"""Opening the daemon's SQLite state file: identity checks, WAL, schema migrations.

One file, ``state.db`` in the state directory. It is ours when its SQLite ``application_id`` is
``APP_ID``; a fresh (empty) file is initialised; anything else (another program's database, a
non-SQLite file, a damaged file, a schema from a newer freetoken) raises ``StoreError`` with a
message that names the file and what to do, never a bare sqlite3 traceback.

Durability: WAL journal with ``synchronous=NORMAL``: a committed transaction survives a crash of
the process (kill -9) and the file always opens consistent; a power cut may roll back the last
few commits, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import sqlite_utils

APP_ID = 0x46545344  # "FTSD" in the SQLite header: this file is a freetoken state store
DB_NAME = "state.db"

Migration = tuple[int, str, Callable[[sqlite_utils.Database], None]]


class StoreError(RuntimeError):
    """The state file cannot be used; the message says which file and why."""


def open_database(
    path: Path, migrations: list[Migration], upto: int | None = None
) -> sqlite_utils.Database:
    """Opens (creating if needed) the store at ``path`` and migrates it to the newest version
    (or to ``upto``: tests build old stores this way)."""
    try:
        conn = sqlite3.connect(str(path), check_same_thread=False, timeout=10.0)
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot open the state store: {e}") from None
    try:
        db = sqlite_utils.Database(conn, execute_plugins=False)
        db.execute("PRAGMA busy_timeout = 10000")
        with _setup_lock(path):
            _check_header(db, path)
            _check_identity(db, path)
            db.enable_wal()
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("PRAGMA foreign_keys = ON")
            _migrate(db, path, migrations, upto)
        return db
    except StoreError:
        conn.close()
        raise
    except sqlite3.DatabaseError as e:
        conn.close()
        raise StoreError(
            f"{path}: the state store is damaged ({e}); move it aside and the daemon starts a new "
            "one (bandwidth profiles, the model registry and snapshot metadata are then lost)"
        ) from None


@contextlib.contextmanager
def _setup_lock(path: Path) -> Iterator[None]:
    """One store set up at a time (identity, WAL switch, migrations), across processes and
    threads: an flock on ``state.db.lock`` beside the database (never on the database itself,
    whose POSIX locks are SQLite's). Two daemons, or the daemon and ftctl, opening a new folder at
    the same moment otherwise race: switching to WAL and upgrading a read to a write can fail at
    once with "database is locked", SQLite's deadlock avoidance, without waiting."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _check_header(db: sqlite_utils.Database, path: Path) -> None:
    """A file that is not SQLite at all gets its own message. SQLite reads the header itself:
    opening and closing the file from Python would drop every POSIX lock this process holds on
    it (an earlier Store's in the same process), and another process closing its connection
    would then take itself for the last one and delete the WAL that ours still writes to."""
    try:
        db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as e:
        if "not a database" not in str(e):
            raise
        raise StoreError(
            f"{path}: not a freetoken state store (not an SQLite database); move it aside or "
            "choose another state directory"
        ) from None


def _check_identity(db: sqlite_utils.Database, path: Path) -> None:
    app_id = db.execute("PRAGMA application_id").fetchone()[0]
    if app_id == 0:
        # Read and claim under the write lock: a store opened at the same moment may claim and
        # migrate the file between two unlocked reads (id 0, then its tables: "another program").
        with write_transaction(db):
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            tables = db.table_names()
            if app_id == 0 and not tables:
                db.execute(f"PRAGMA application_id = {APP_ID}")  # a new, empty file becomes ours
                return
    if app_id == APP_ID:
        problems = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise StoreError(
                f"{path}: the state store is damaged ({'; '.join(problems[:3])}); move it aside"
            )
        return
    raise StoreError(
        f"{path}: an SQLite database of another program (application_id {app_id:#x}, tables "
        f"{', '.join(db.table_names()[:5]) or 'none'}); not touching it: choose another state directory"
    )


@contextlib.contextmanager
def write_transaction(db: sqlite_utils.Database) -> Iterator[None]:
    """A transaction that takes the write lock at BEGIN (``BEGIN IMMEDIATE``), waiting up to the
    busy timeout for it; nested, a savepoint. sqlite-utils' ``atomic()`` begins deferred: a
    transaction that reads first and writes later fails at once with "database is locked" when
    another process committed in between (WAL cannot upgrade a stale read snapshot, and the busy
    handler is not called for that), which two daemons, or the daemon and ftctl, starting
    together hit."""
    if db.conn.in_transaction:
        with db.atomic():
            yield
        return
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise
    else:
        db.conn.execute("COMMIT")


def schema_version(db: sqlite_utils.Database) -> int:
    if "schema_version" not in db.table_names():
        return 0
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def _migrate(
    db: sqlite_utils.Database, path: Path, migrations: list[Migration], upto: int | None
) -> None:
    versions = [v for v, _, _ in migrations]
    assert versions == list(range(1, len(versions) + 1)), "migrations must be numbered 1, 2, ..."
    latest = len(migrations)
    have = schema_version(db)
    if have > latest:
        raise StoreError(
            f"{path}: written by a newer freetoken (schema version {have}, this one knows {latest}); "
            "upgrade freetoken or use another state directory"
        )
    for version, description, apply in migrations[have : upto if upto is not None else latest]:
        with write_transaction(db):  # each step commits whole or not at all
            if schema_version(db) >= version:  # another process applied it while we waited
                continue
            if version == 1:
                db.execute(
                    "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, description TEXT NOT NULL, "
                    "applied_at REAL NOT NULL)"
                )
            apply(db)
            db.execute(
                "INSERT INTO schema_version (version, description, applied_at) VALUES (?, ?, ?)",
                (version, description, time.time()),
            )
            db.execute(f"PRAGMA user_version = {version}")

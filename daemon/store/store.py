"""Store: the daemon's persistent state (one SQLite file), a small typed facade over the tables.

Thread-safe: one connection, every call under one lock; ``transaction()`` groups calls into one
atomic commit. Implements the control plane's ``ControlStore`` protocol
(daemon/manager/store_api.py): ``save_bandwidth``, ``bandwidth``, ``register_model``,
``registered_models``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..runtime.bandwidth import BandwidthProfile
from . import anchors, bandwidth, models, request_log
from .anchors import AnchorRecord
from .bandwidth import BandwidthRow
from .db import DB_NAME, open_database, schema_version, write_transaction
from .models import ModelRecord
from .private import private_dir, private_file, restrict
from .request_log import RequestEntry
from .schema import MIGRATIONS


class Store:
    """The state store of ``state_dir`` (``state_dir/state.db``, created on first use).

    request_log_rows  how many request-log rows are kept (a ring: older rows are dropped)
    """

    def __init__(
        self, state_dir: str | Path, request_log_rows: int = 10000, *, _upto: int | None = None
    ) -> None:
        self.state_dir = private_dir(Path(state_dir))
        self.path = self.state_dir / DB_NAME
        # SQLite gives the -wal and -shm files the mode of the database file: create it 0600
        private_file(self.path)
        for suffix in ("-wal", "-shm", "-journal"):  # left by an older version, maybe 0644
            restrict(self.path.with_name(DB_NAME + suffix))
        self.request_log_rows = request_log_rows
        self._db = open_database(self.path, MIGRATIONS, upto=_upto)
        self._lock = threading.RLock()
        self.host = socket.gethostname()

    @property
    def version(self) -> int:
        with self._lock:
            return schema_version(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Everything inside commits together, or (on an exception) not at all."""
        with self._lock, write_transaction(self._db):
            yield

    # ---- bandwidth profiles ------------------------------------------------------------------
    def save_bandwidth_row(self, row: BandwidthRow) -> None:
        with self.transaction():
            bandwidth.save(self._db, row)

    def latest_bandwidth(self, gpu: str, fmt: str, host: str | None = None) -> BandwidthRow | None:
        with self._lock:
            return bandwidth.latest(self._db, host or self.host, gpu, fmt)

    def save_bandwidth(self, profile: BandwidthProfile) -> None:
        """ControlStore: stores a measured profile for this host."""
        row = BandwidthRow(
            self.host,
            profile.accelerator,
            profile.expert_format,
            profile.b_p,
            profile.b_h,
            time.time(),
            profile.expert_bytes,
            profile.b_d,
            profile.disk_direct,
            profile.disk_path,
            profile.disk_note,
        )
        self.save_bandwidth_row(row)

    def bandwidth(self, expert_format: str, accelerator: str) -> BandwidthProfile | None:
        """ControlStore: the latest profile of this host for the format and accelerator."""
        row = self.latest_bandwidth(accelerator, expert_format)
        if row is None:
            return None
        return BandwidthProfile(
            row.b_p,
            row.b_h,
            row.format,
            row.gpu,
            row.expert_bytes,
            row.b_d,
            row.disk_direct,
            row.disk_path,
            row.disk_note,
        )

    # ---- model registry ----------------------------------------------------------------------
    def register(self, rec: ModelRecord) -> None:
        with self.transaction():
            models.register(self._db, rec)

    def register_model(self, name: str, path: str) -> None:
        """ControlStore: records (or refreshes) a loaded checkpoint folder."""
        folder = Path(path)
        self.register(
            ModelRecord(
                str(folder),
                name,
                models.model_format(folder),
                models.model_fingerprint(folder),
                time.time(),
            )
        )

    def registered_models(self) -> dict[str, str]:
        """ControlStore: model name -> folder (the most recently used folder of a name wins)."""
        out: dict[str, str] = {}
        for rec in self.models():
            out.setdefault(rec.name, rec.path)
        return out

    def model(self, path: str) -> ModelRecord | None:
        with self._lock:
            return models.get(self._db, path)

    def models(self) -> list[ModelRecord]:
        with self._lock:
            return models.all_models(self._db)

    def touch_model(self, path: str) -> None:
        with self.transaction():
            models.touch(self._db, path, time.time())

    # ---- anchors (snapshot metadata) ---------------------------------------------------------
    def put_anchor(self, rec: AnchorRecord) -> None:
        with self.transaction():
            anchors.put(self._db, rec)

    def anchors(self, fingerprint: str) -> list[AnchorRecord]:
        with self._lock:
            return anchors.for_model(self._db, fingerprint)

    def touch_anchor(self, fingerprint: str, prefix_hash: str) -> None:
        with self.transaction():
            anchors.touch(self._db, fingerprint, prefix_hash, time.time())

    def delete_anchor(self, fingerprint: str, prefix_hash: str) -> None:
        with self.transaction():
            anchors.delete(self._db, fingerprint, prefix_hash)

    def anchor_bytes(self, fingerprint: str) -> int:
        with self._lock:
            return anchors.total_bytes(self._db, fingerprint)

    # ---- request log -------------------------------------------------------------------------
    def log_request(self, entry: RequestEntry) -> None:
        with self.transaction():
            request_log.append(self._db, entry, self.request_log_rows)

    def recent_requests(self, n: int = 100) -> list[RequestEntry]:
        with self._lock:
            return request_log.recent(self._db, n)

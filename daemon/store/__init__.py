"""The daemon's persistent state: one SQLite file (``state.db``) in the state directory.

Bandwidth profiles, the model registry, prefix-reuse anchor metadata and a bounded request log,
through ``Store``. A foreign or damaged file raises ``StoreError`` (a one-line reason).
"""

from __future__ import annotations

from pathlib import Path

from .anchors import AnchorRecord
from .bandwidth import BandwidthRow
from .db import DB_NAME, StoreError
from .models import ModelRecord, model_fingerprint
from .request_log import RequestEntry
from .store import Store

__all__ = [
    "DB_NAME",
    "AnchorRecord",
    "BandwidthRow",
    "ModelRecord",
    "RequestEntry",
    "Store",
    "StoreError",
    "control_store",
    "model_fingerprint",
]


def control_store(state_dir: Path) -> Store:
    """The store the control plane uses (daemon/manager/store_api.py ``open_store``)."""
    return Store(state_dir)

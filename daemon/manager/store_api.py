"""What the control plane keeps in the state store: bandwidth profiles and the model registry.

The SQLite store (``freetokend.store``, ``control_store``) implements this small interface;
``MemoryStore`` keeps the same data for the life of the process where that store is missing
(``open_store`` says so once in the log), and in tests.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from ..runtime.bandwidth import BandwidthProfile

log = logging.getLogger(__name__)


class ControlStore(Protocol):
    def save_bandwidth(self, profile: BandwidthProfile) -> None: ...

    def bandwidth(self, expert_format: str, accelerator: str) -> BandwidthProfile | None:
        """The latest stored profile for this expert format on this accelerator kind."""
        ...

    def register_model(self, name: str, path: str) -> None: ...

    def registered_models(self) -> dict[str, str]:
        """Model name -> folder, for every model the daemon has loaded."""
        ...


class MemoryStore:
    def __init__(self) -> None:
        self._bw: dict[tuple[str, str], BandwidthProfile] = {}
        self._models: dict[str, str] = {}

    def save_bandwidth(self, profile: BandwidthProfile) -> None:
        self._bw[(profile.expert_format, profile.accelerator)] = profile

    def bandwidth(self, expert_format: str, accelerator: str) -> BandwidthProfile | None:
        return self._bw.get((expert_format, accelerator))

    def register_model(self, name: str, path: str) -> None:
        self._models[name] = path

    def registered_models(self) -> dict[str, str]:
        return dict(self._models)


def open_store(state_dir: Path) -> ControlStore:
    """The persistent store when available, else a MemoryStore."""
    try:
        # deferred: optional native/store module (its ImportError is handled here)
        from ..store import control_store
    except ImportError:
        log.info("state store: no persistent store yet; profiles and registry kept in memory")
        return MemoryStore()
    store: ControlStore = control_store(state_dir)
    return store

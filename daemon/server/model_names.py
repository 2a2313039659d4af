"""Which model answers the name a request sends.

Clients send whatever name they were configured with: ``default``, a Claude or GPT model id
when a coding agent was pointed at the daemon by hand. A name that is a served model's name
(or an alias of one, ``model_aliases`` in the config) picks that model; any other name is
answered by the active model, whose name the response carries, unless
``strict_model_names`` is set (then it is a 404). Each new unmatched name is logged once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import structlog

log = structlog.get_logger("freetokend.models")

MAX_LOGGED_NAMES = 1000  # unmatched names remembered for the one-line-per-name log


class ModelNames:
    def __init__(self, aliases: Mapping[str, str] | None = None, strict: bool = False) -> None:
        self.aliases = dict(aliases or {})
        self.strict = strict
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def canonical(self, name: str) -> str:
        """The model an alias stands for; any other name as it is."""
        return self.aliases.get(name, name)

    def is_alias(self, name: str) -> bool:
        return name in self.aliases

    def fallback(self, name: str, active: str) -> bool:
        """True when a name that matches no model is to be served by ``active`` (not strict);
        logs the first use of each such name."""
        if self.strict:
            return False
        with self._lock:
            if name in self._seen or len(self._seen) >= MAX_LOGGED_NAMES:
                return True
            self._seen.add(name)
        log.info("unknown model name served by the active model", requested=name, model=active)
        return True

"""freetokend: an edge-native MoE inference daemon.

``from freetokend import LLM`` is the offline API (imported lazily: the daemon's CLI should not
pay for torch before it parses its flags).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine.llm import LLM

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        # deferred: torch (the CLI and `import freetokend` start without it)
        from .engine.llm import LLM

        return LLM
    raise AttributeError(name)

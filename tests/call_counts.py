"""Counting the calls a test's code makes to functions of a module (monkeypatched wrappers)."""

from __future__ import annotations

from types import ModuleType


def count_calls(monkeypatch, module: ModuleType, *names: str) -> dict[str, int]:
    """Wraps ``module``'s functions ``names`` for the test: the returned dict counts their
    calls by name (callers must reach them through the module's attribute)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(module, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return calls

"""Run a kernel module's Triton kernels in the interpreter for CPU tensors, without a
process-wide ``TRITON_INTERPRET``.

``@triton.jit`` decides at decoration time whether a function is compiled or interpreted, so a
module imported normally only ever compiles. ``for_device(module, device)`` returns the module
itself for accelerator tensors and, for CPU tensors, a twin of it imported once with the
interpreter switched on inside a knob scope (the environment is restored right after), so CUDA
tests and interpreted tests can share one process. With ``TRITON_INTERPRET=1`` set by the user
the module is already interpreted and is returned as is.

Triton's own library functions (``tl.sort``, ``tl.cumsum``, ``tl.cdiv``...) were decorated when
triton was imported, compiled; while a twin's kernel runs, a call to such a function from
interpreted code is interpreted too (``JITFunction.__call__`` only raises otherwise). Interpreted
launches are serialised: the interpreter patches ``triton.language`` while it runs.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_twins: dict[str, ModuleType] = {}
_lock = threading.Lock()
_run_lock = threading.Lock()


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    return InterpretedFunction(self.fn)(*args, **kwargs)


def _serialised(run: Any) -> Any:
    def launch(*args: Any, **kwargs: Any) -> Any:
        with _run_lock:
            saved = JITFunction.__call__
            JITFunction.__call__ = _call_interpreted  # type: ignore[method-assign]
            try:
                return run(*args, **kwargs)
            finally:
                JITFunction.__call__ = saved  # type: ignore[method-assign]

    return launch


def interpreted(module: ModuleType) -> ModuleType:
    """The interpreted twin of a kernel module (imported on first use, then cached)."""
    if getattr(module, "__interpreted__", False):
        return module
    with _lock:
        twin = _twins.get(module.__name__)
        if twin is None:
            spec = importlib.util.find_spec(module.__name__)
            if spec is None or spec.origin is None:
                raise ImportError(f"cannot locate the source of {module.__name__}")
            name = module.__name__ + "__interpreted"
            twin_spec = importlib.util.spec_from_file_location(name, spec.origin)
            assert twin_spec is not None and twin_spec.loader is not None
            twin = importlib.util.module_from_spec(twin_spec)
            twin.__interpreted__ = True  # type: ignore[attr-defined]
            sys.modules[name] = twin  # dataclasses and typing resolve names through it
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = True
                twin_spec.loader.exec_module(twin)
            for value in vars(twin).values():
                if isinstance(value, InterpretedFunction):
                    value.run = _serialised(value.run)  # type: ignore[method-assign]
            _twins[module.__name__] = twin
        return twin


def for_device(module: ModuleType, device: torch.device) -> ModuleType:
    """``module`` for accelerator tensors; its interpreted twin for CPU tensors."""
    if device.type != "cpu" or triton.knobs.runtime.interpret:
        return module
    return interpreted(module)

"""``torch.Generator("cuda")`` on the fake device (the CPU build of torch has no CUDA generator).

During a fake session ``torch.Generator`` is replaced by ``GeneratorFactory``: asked for a CUDA
generator it returns a ``FakeCudaGenerator`` (a real ``torch.Generator`` on the host whose
``device`` says ``cuda:0``: seeding, ``get_state``/``set_state`` work; the fake tensors it is
passed to draw no values anyway); any other device gets torch's own generator. The factory's
metaclass keeps ``isinstance(g, torch.Generator)`` true for real and fake generators alike, so
code checking generators keeps working while the session is open.
"""

from __future__ import annotations

from typing import Any

import torch

RealGenerator = torch.Generator
CUDA0 = torch.device("cuda", 0)


class FakeCudaGenerator(RealGenerator):
    """A host generator reporting device ``cuda:0``."""

    def __new__(cls, device: object = None) -> FakeCudaGenerator:
        return super().__new__(cls, device="cpu")  # type: ignore[call-arg]

    def __init__(self, device: object = None) -> None:
        pass  # the C type was initialised by __new__

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA0


class _FactoryMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, RealGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, RealGenerator)


class GeneratorFactory(metaclass=_FactoryMeta):
    """What ``torch.Generator`` is while a fake session is open."""

    def __new__(cls, device: Any = "cpu") -> Any:  # type: ignore[misc]
        if torch.device(device).type == "cuda":
            return FakeCudaGenerator()
        return RealGenerator(device)

"""Python-level routing that lets the CPU build of torch run CUDA code on fake tensors.

With the CPU build, ``FakeTensor``s on ``cuda:0`` go through the dispatcher fine (matmul, SDPA,
reductions, custom ops with fake implementations), but a few Python bindings open a CUDA
device guard before dispatching and raise "not linked with support for cuda devices":
``t[i]``, ``t[i] = v``, ``t.copy_(s)``, ``int(t)`` and friends, and a bare ``"cuda"`` device
string (its index is resolved through the guard). This ``TorchFunctionMode`` intercepts those
calls and issues the aten ops directly, which is what the bindings do after the guard. Calls
that name a CUDA device (factories, ``.to``) run under the fake mode, so host code that was
written for a GPU creates fake device tensors while host tensors stay real (their values are
readable: index bookkeeping on the host keeps working).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
CUDA0 = torch.device("cuda", 0)

_SCALAR_READS = {
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.item,
    torch.Tensor.tolist,
}


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def is_fake(t: object) -> bool:
    return isinstance(t, FakeTensor)


def _norm_device(d: object) -> object:
    """``"cuda"`` / ``torch.device("cuda")`` -> ``cuda:0``; anything else unchanged."""
    if isinstance(d, str) and d.split(":")[0] == "cuda":
        return CUDA0 if d == "cuda" else torch.device(d)
    if isinstance(d, torch.device) and d.type == "cuda" and d.index is None:
        return CUDA0
    return d


def _names_cuda(args: tuple, kwargs: dict) -> bool:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cuda":
        return True
    return any(
        isinstance(a, torch.device)
        and a.type == "cuda"
        or isinstance(a, str)
        and a.split(":")[0] == "cuda"
        for a in args
    )


# ---- indexing --------------------------------------------------------------------------------
def _as_index_tensor(i: object, device: torch.device) -> torch.Tensor:
    if isinstance(i, torch.Tensor):
        return i
    return torch.tensor(i, dtype=torch.long)


def _basic_and_advanced(
    t: torch.Tensor, index: object
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Applies ints, slices, None and Ellipsis as views; returns the view and the advanced
    (tensor / list) indices per remaining dim (None where a dim is not indexed)."""
    idx = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
        consumed += sum(
            i.dim() - 1 for i in idx if isinstance(i, torch.Tensor) and i.dtype == torch.bool
        )
    out, dim = t, 0
    adv: list[torch.Tensor | None] = []
    for i in idx:
        if i is Ellipsis:
            skip = t.dim() - consumed
            adv.extend([None] * skip)
            dim += skip
        elif i is None:
            out = aten.unsqueeze.default(out, dim)
            adv.append(None)
            dim += 1
        elif isinstance(i, bool):
            raise NotImplementedError("fake-cuda shim: bool scalar index")
        elif isinstance(i, int) or (
            isinstance(i, torch.Tensor)
            and i.dim() == 0
            and not i.is_floating_point()
            and i.dtype != torch.bool
            and not is_fake(i)
        ):
            out = aten.select.int(out, dim, int(i))
        elif isinstance(i, slice):
            step = 1 if i.step is None else i.step
            out = aten.slice.Tensor(out, dim, i.start, i.stop, step)
            adv.append(None)
            dim += 1
        else:
            ti = _as_index_tensor(i, t.device)
            adv.append(ti)
            dim += ti.dim() if ti.dtype == torch.bool else 1
    while adv and adv[-1] is None:
        adv.pop()
    return out, adv


def getitem(t: torch.Tensor, index: object) -> torch.Tensor:
    view, adv = _basic_and_advanced(t, index)
    if not adv:
        return view
    return aten.index.Tensor(view, adv)


def setitem(t: torch.Tensor, index: object, value: object) -> None:
    view, adv = _basic_and_advanced(t, index)
    if not adv:
        if isinstance(value, torch.Tensor):
            aten.copy_.default(view, value)
        else:
            aten.fill_.Scalar(view, value)
        return
    only = [a for a in adv if a is not None]
    if len(adv) == 1 and only[0].dtype == torch.bool and not isinstance(value, torch.Tensor):
        aten.masked_fill_.Scalar(view, only[0], value)  # no sync, as torch does for t[mask] = s
        return
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=t.dtype, device=t.device)  # type: ignore[call-overload]
    aten.index_put_.default(view, adv, value)


class DeviceShim(TorchFunctionMode):
    """Routes the Python bindings that open a CUDA device guard to their aten ops."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first: Any = args[0] if args else None
        if func is torch.Tensor.__getitem__ and is_fake(first):
            return getitem(first, args[1])
        if func is torch.Tensor.__setitem__ and is_fake(first):
            return setitem(first, args[1], args[2])
        if func is torch.Tensor.copy_ and (is_fake(first) or is_fake(args[1])):
            nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return aten.copy_.default(first, args[1], bool(nb))  # the tracker reads the flag
        if func is torch.Tensor.__invert__ and is_fake(first):
            # ``~mask``: its binding opens a CUDA device guard under inference mode
            return aten.bitwise_not.default(first)
        if func in (torch.nonzero, torch.Tensor.nonzero) and is_fake(first):
            nz = aten.nonzero.default(first)  # flagged as a sync by the tracker
            if kwargs.get("as_tuple") or (len(args) > 1 and args[1]):
                return tuple(aten.select.int(nz, 1, d) for d in range(first.dim()))
            return nz
        if func in _SCALAR_READS and is_fake(first):
            # a data-dependent read: counted by the tracker, raises in the fake mode
            return aten._local_scalar_dense.default(first)
        gen = kwargs.get("generator")
        if gen is not None and (is_fake(first) or _names_cuda(args, kwargs)):
            if gen.device.type != "cuda":  # as CUDA refuses a host generator
                raise RuntimeError(
                    f"expected a 'cuda' device type for generator but found '{gen.device.type}'"
                )
        if func is torch.Tensor.cuda:
            return self.__torch_function__(torch.Tensor.to, types, (first, CUDA0), {})
        if func is not torch.device and _names_cuda(args, kwargs):
            args = tuple(_norm_device(a) for a in args)
            if "device" in kwargs:
                kwargs = {**kwargs, "device": _norm_device(kwargs["device"])}
            if func in _FROM_DATA:  # built on the host inside C++, where no mode sees it
                dev = kwargs.pop("device", CUDA0)
                return func(*args, **kwargs).to(dev)
        return func(*args, **kwargs)

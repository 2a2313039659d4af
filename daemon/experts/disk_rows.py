"""An overlapped decode call's kernel calls (experts/disk_tier.py ``TieredExecutor._overlapped``,
issue 45): a token's routes computed in groups as their experts' reads land, each group a row
of a call over the RAM cache's slots, the rows' results added up in the kernel's order."""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


def row_buffers(b: dict[str, Tensor] | None, k: int, h: int) -> dict[str, Tensor]:
    """An overlapped call's buffers of k + 1 rows of hidden size ``h`` (see ``Rows``): ``b``,
    reused where it has them."""
    if b is None or b["ids"].shape[1] != k:
        n = k + 1
        b = {
            "x": torch.empty(n, h, dtype=torch.float32),
            "ids": torch.empty(n, k, dtype=torch.int32),
            "w": torch.empty(n, k, dtype=torch.float32),
            "order": torch.empty(n, k, dtype=torch.int32),
            "out": torch.empty(n, h, dtype=torch.float32),
        }
    return b


class Rows:
    """An overlapped decode call's kernel calls (``disk_tier.TieredExecutor._overlapped``): each
    call's rows are groups of the token's route positions (a group's routes summed in the kernel's
    order), each row the token's x, gate weights and order with the ids of its group's slots
    (-1 elsewhere); the results go to consecutive rows of ``buf["out"]`` (k + 1 rows: the
    leading group and each other route once)."""

    def __init__(
        self, buf: dict[str, Tensor], x: Tensor, w: Tensor, order: Tensor,
        slot_of: dict[int, int], row: list[int],
    ) -> None:  # fmt: skip
        self.buf, self.x, self.w, self.order = buf, x, w, order
        self.slot_of, self.row = slot_of, row
        self.at: dict[int, int] = {}  # route position -> the row holding its term (or sum)
        self.used = 0

    def run(self, groups: list[list[int]], inner: Any) -> None:
        """One kernel call, a row per group (none: no call)."""
        if not groups:
            return
        b, m, k = self.buf, len(groups), len(self.row)
        ids = [[-1] * k for _ in groups]
        for i, js in enumerate(groups):
            for j in js:
                ids[i][j] = self.slot_of[self.row[j]]
                self.at[j] = self.used + i
        b["x"][:m] = self.x
        b["ids"][:m] = torch.tensor(ids, dtype=torch.int32)
        b["w"][:m] = self.w
        b["order"][:m] = self.order
        inner.forward_addresses(
            b["x"].data_ptr(), b["ids"].data_ptr(), b["w"].data_ptr(),
            b["out"][self.used].data_ptr(), m, k, b["order"].data_ptr(),
        )  # fmt: skip
        self.used += m

    def of(self, j: int) -> Tensor:
        """The row of route position ``j``'s term (or of the leading sum it is in)."""
        return self.buf["out"][self.at[j]]

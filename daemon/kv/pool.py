"""Paged KV pool for the full- and sliding-attention layers.

Storage per attention layer: K and V of shape [num_pages, page_size, kv_heads, head_dim]. A
sequence owns a list of pages (its page table); token position p lives in page
``pages[p // page_size]`` at row ``p % page_size``.
"""

from __future__ import annotations

import torch


class KVPoolFull(RuntimeError):
    """Not enough free pages for the request."""


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (max(num_layers, 1), num_pages, page_size, kv_heads, head_dim)
        # Not zeroed: a page is always written before it is read.
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolFull(f"need {n} KV pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for pg in out:
            self._ref[pg] = 1
        return out

    def retain(self, pages: list[int]) -> None:
        for pg in pages:
            assert self._ref[pg] > 0, f"page {pg} is free"
            self._ref[pg] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page."""
        for pg in reversed(pages):
            assert self._ref[pg] > 0, f"page {pg} freed twice"
            self._ref[pg] -= 1
            if self._ref[pg] == 0:
                self._free.append(pg)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def resize(self, n: int) -> None:
        """New storage of ``n`` pages holding the first min(n, old) pages; the free list and the
        reference counts follow. Shrinking needs the dropped pages free (KVPoolFull else)."""
        old = self.num_pages
        busy = [p for p in range(n, old) if self._ref[p]]
        if busy:
            raise KVPoolFull(f"cannot shrink to {n} pages: {len(busy)} pages above are in use")
        keep = min(n, old)
        shape = (self.k.shape[0], n, *self.k.shape[2:])
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.empty(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :keep].copy_(self.k[:, :keep])
        v[:, :keep].copy_(self.v[:, :keep])
        free = [p for p in self._free if p < n]
        # The free list is a stack (alloc pops from the end): new pages go to the bottom, so the
        # lowest free pages are used first, which keeps a later shrink cheap.
        self._free = list(range(n - 1, old - 1, -1)) + free
        self._ref = self._ref[:n] + [0] * max(0, n - old)
        self.k, self.v, self.num_pages = k, v, n

    def copy_page(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` token rows of page ``src`` into page ``dst`` (all layers)."""
        self.k[:, dst, :rows] = self.k[:, src, :rows]
        self.v[:, dst, :rows] = self.v[:, src, :rows]

    def write(
        self, layer: int, pages: list[int], start: int, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """Store k, v [n, kv_heads, head_dim] at positions [start, start + n). ``v=None`` stores
        K alone (MLA keeps its whole compressed latent there; V's pages are then never touched,
        so never committed)."""
        # One slice copy per page span (a decode token: one per tensor), not an index_put with
        # its index tensors: at decode this is a few microseconds instead of ~40 per layer.
        ps, n, i = self.page_size, k.shape[0], 0
        while i < n:
            page, row = divmod(start + i, ps)
            m = min(ps - row, n - i)
            self.k[layer, pages[page], row : row + m] = k[i : i + m]
            if v is not None:
                self.v[layer, pages[page], row : row + m] = v[i : i + m]
            i += m

    def read(
        self, layer: int, pages: list[int], length: int, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [start, length) as [length - start, kv_heads, head_dim]."""
        first, last = start // self.page_size, self.pages_for(length)
        table = torch.tensor(pages[first:last], dtype=torch.long)
        lo = start - first * self.page_size
        k = self.k[layer, table].flatten(0, 1)[lo : lo + length - start]
        v = self.v[layer, table].flatten(0, 1)[lo : lo + length - start]
        return k, v

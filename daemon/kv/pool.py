"""Paged KV pool for the full- and sliding-attention layers.

Storage per attention layer: K and V of shape [num_pages, page_size, kv_heads, head_dim]. A
sequence owns a list of pages (its page table); token position p lives in page
``pages[p // page_size]`` at row ``p % page_size``.

When every layer has the same (kv_heads, head_dim), K and V are each one tensor
[layers, num_pages, page_size, kv_heads, head_dim]. A model whose layers differ (Gemma-4's global
layers have another head dim and KV head count than its sliding ones) passes ``layer_shapes``:
K and V are then lists of per-layer tensors, so no layer pays for another's geometry. Either way
``k[layer]`` is that layer's [num_pages, page_size, kv_heads, head_dim] storage.

Page regions (``regions``): rows a page holds beside its tokens' K and V, for state that grows
by less than one row per token (DeepSeek-V4's compressed entries: one per ``rate`` tokens).
Region i is fp32 [num_pages, rows_i, width_i]; a page's rows belong to its tokens (the model
decides which row holds what), so they are shared, retained, copied on write and freed with
the page, as its K and V are: a prefix's pages in the radix tree carry them.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        layer_shapes: Sequence[tuple[int, int]] | None = None,
        device: torch.device | None = None,
        regions: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``layer_shapes``: (kv_heads, head_dim) per layer, for models whose layers differ
        (``kv_heads`` / ``head_dim`` are then ignored). ``device``: where the storage lives (the
        accelerator's device when the dense part runs there; default the host). ``regions``:
        (rows per page, width) of each page region (module docstring)."""
        self.page_size = page_size
        self.num_pages = num_pages
        self.k: torch.Tensor | list[torch.Tensor]
        self.v: torch.Tensor | list[torch.Tensor]
        shapes = list(layer_shapes or [])
        if shapes and len(shapes) != num_layers:
            raise ValueError(f"layer_shapes lists {len(shapes)} layers, expected {num_layers}")
        if shapes and len(set(shapes)) > 1:
            # Not zeroed: a page is always written before it is read.
            self.k = [
                torch.empty(num_pages, page_size, *s, dtype=dtype, device=device) for s in shapes
            ]
            self.v = [
                torch.empty(num_pages, page_size, *s, dtype=dtype, device=device) for s in shapes
            ]
        else:
            if shapes:
                kv_heads, head_dim = shapes[0]
            shape = (max(num_layers, 1), num_pages, page_size, kv_heads, head_dim)
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        for rows, width in regions:
            if rows < 1 or width < 1:
                raise ValueError(f"a page region of {rows} rows of width {width}")
        # Not zeroed either: a row is written before it is read.
        self.regions = [
            torch.empty(num_pages, rows, width, dtype=torch.float32, device=device)
            for rows, width in regions
        ]
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref = [0] * num_pages

    @property
    def per_layer(self) -> bool:
        """K and V are lists of per-layer tensors (layers of different geometry)."""
        return isinstance(self.k, list)

    @property
    def layer_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) of each layer's K (= V)."""
        return [(int(t.shape[-2]), int(t.shape[-1])) for t in self.k]

    @property
    def dtype(self) -> torch.dtype:
        return self._first.dtype

    @property
    def device(self) -> torch.device:
        return self._first.device

    @property
    def _first(self) -> torch.Tensor:
        """A storage tensor (read without indexing: no op on a device tensor)."""
        return self.k[0] if isinstance(self.k, list) else self.k

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage, all layers, and of the page regions."""
        kv = 2 * sum(t.numel() * t.element_size() for t in self.k)
        return kv + sum(t.numel() * t.element_size() for t in self.regions)

    @property
    def layout(self) -> str:
        """The storage layout a spilled file must match (fingerprint part): layers, geometry,
        dtype. The uniform form is spelled as before per-layer pools existed."""
        regions = "".join(f"|region {tuple(t.shape[1:])}" for t in self.regions)
        if self.per_layer:
            return f"{self.page_size}|per-layer {tuple(self.layer_shapes)}|{self.dtype}{regions}"
        k = self.k
        assert isinstance(k, torch.Tensor)
        return f"{self.page_size}|{tuple(k.shape[:1] + k.shape[3:])}|{k.dtype}{regions}"

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
        if isinstance(self.k, list) and isinstance(self.v, list):
            self.k = [_resized(t, n, keep, 0) for t in self.k]
            self.v = [_resized(t, n, keep, 0) for t in self.v]
        else:
            assert isinstance(self.k, torch.Tensor) and isinstance(self.v, torch.Tensor)
            self.k, self.v = _resized(self.k, n, keep, 1), _resized(self.v, n, keep, 1)
        self.regions = [_resized(t, n, keep, 0) for t in self.regions]
        free = [p for p in self._free if p < n]
        # The free list is a stack (alloc pops from the end): new pages go to the bottom, so the
        # lowest free pages are used first, which keeps a later shrink cheap.
        self._free = list(range(n - 1, old - 1, -1)) + free
        self._ref = self._ref[:n] + [0] * max(0, n - old)
        self.num_pages = n

    def copy_page(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` token rows of page ``src`` into page ``dst`` (all layers), and
        every row of its regions (those not yet valid for ``dst``'s sequence are written again
        before they are read)."""
        for t in self.regions:
            t[dst] = t[src]
        if isinstance(self.k, list) and isinstance(self.v, list):
            for t in (*self.k, *self.v):
                t[dst, :rows] = t[src, :rows]
            return
        assert isinstance(self.k, torch.Tensor) and isinstance(self.v, torch.Tensor)
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
        kl, vl = self.k[layer], self.v[layer]
        while i < n:
            page, row = divmod(start + i, ps)
            m = min(ps - row, n - i)
            kl[pages[page], row : row + m] = k[i : i + m]
            if v is not None:
                vl[pages[page], row : row + m] = v[i : i + m]
            i += m

    def read(
        self, layer: int, pages: list[int] | torch.Tensor, length: int, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [start, length) as [length - start, kv_heads, head_dim].

        ``pages``: the sequence's page table, a list or an int64 tensor on the pool's device
        (a decode step passes the tensor its runner sent once for all layers: a list costs a
        host -> device copy here, a host sync on CUDA, per layer and sequence)."""
        first, last = start // self.page_size, self.pages_for(length)
        if isinstance(pages, torch.Tensor):
            table = pages[first:last]  # a view: no copy
        else:
            table = torch.tensor(pages[first:last], dtype=torch.long, device=self.device)
        lo = start - first * self.page_size
        k = self.k[layer][table].flatten(0, 1)[lo : lo + length - start]
        v = self.v[layer][table].flatten(0, 1)[lo : lo + length - start]
        return k, v

    def gather(self, pages: list[int], pos: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of positions [0, pos), one [pos, kv_heads, head_dim] tensor per layer."""
        layers = range(len(self.k))
        ks, vs = zip(*(self.read(i, pages, pos) for i in layers), strict=True)
        return list(ks), list(vs)


def _resized(t: torch.Tensor, n: int, keep: int, dim: int) -> torch.Tensor:
    """New storage like ``t`` with ``n`` pages along ``dim``, the first ``keep`` copied."""
    shape = list(t.shape)
    shape[dim] = n
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, keep).copy_(t.narrow(dim, 0, keep))
    return out

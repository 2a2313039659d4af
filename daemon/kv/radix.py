"""Radix prefix cache over the paged KV pool (page-granular sharing).

Each tree node stands for one FULL page of tokens: its key is the page's ``page_size`` token ids,
its path from the root is the whole prefix, and it holds one reference on its KV page. A new
request walks the tree with its prompt and borrows (retains) the pages of the longest matching
prefix; a finished request inserts its full pages. Nodes that no request uses (page refcount 1,
held by the tree alone) and that have no children are evicted least recently used first when the
pool needs pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .pool import KVPool


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0


class RadixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.ps = pool.page_size
        self.root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.evicted = 0  # pages freed by eviction, ever (a metric)

    def _pages_of(self, tokens: list[int], n_pages: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[i * self.ps : (i + 1) * self.ps]) for i in range(n_pages)]

    def match(self, tokens: list[int]) -> list[int]:
        """Pages of the longest cached prefix of ``tokens`` (full pages only), NOT retained."""
        node, pages, now = self.root, [], next(self._clock)
        for key in self._pages_of(tokens, len(tokens) // self.ps):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        return pages

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], int]:
        """Pages and exact length of the longest cached prefix of ``tokens``, NOT retained.

        The full pages come first; where the prompt leaves the tree inside a page, the child page
        sharing the most leading tokens is appended too (only its first rows hold the prompt's
        KV). Without that page, a resume point inside it (an anchor a few tokens before an edit)
        would fall back to the previous snapshot, possibly a whole turn earlier.
        """
        node, pages, now = self.root, [], next(self._clock)
        ps = self.ps
        for i in range(-(-len(tokens) // ps)):
            want = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(want) if len(want) == ps else None
            if child is None:
                best, rows = None, 0
                for key, cand in node.children.items():
                    n = _common(key, want)
                    if n > rows:
                        best, rows = cand, n
                if best is not None:
                    best.last_access = now
                    pages.append(best.page)
                return pages, i * ps + rows
            child.last_access = now
            pages.append(child.page)
            node = child
        return pages, len(pages) * ps

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Adds the full pages of a sequence (``pages[i]`` holds tokens of page i). Pages the tree
        takes are retained; where the tree already has that prefix its own page is kept."""
        node, now = self.root, next(self._clock)
        n = min(len(tokens) // self.ps, len(pages))
        for key, page in zip(self._pages_of(tokens, n), pages[:n], strict=True):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, page, node)
                node.children[key] = child
                self.pool.retain([page])
                self.num_nodes += 1
            child.last_access = now
            node = child

    def evictable(self) -> int:
        return sum(1 for n in self._nodes() if not n.children and self.pool.refcount(n.page) == 1)

    def evict(self, n_pages: int) -> int:
        """Frees up to ``n_pages`` pages held by the tree alone, oldest leaves first."""
        freed = 0
        while freed < n_pages:
            leaves = [n for n in self._nodes() if not n.children and self.pool.refcount(n.page) == 1]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_access)
            for leaf in leaves[: n_pages - freed]:
                assert leaf.parent is not None
                del leaf.parent.children[leaf.key]
                self.pool.free([leaf.page])
                self.num_nodes -= 1
                self.evicted += 1
                freed += 1
        return freed

    def cached_pages(self) -> int:
        return self.num_nodes

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def clear(self) -> None:
        self.evict(self.num_nodes)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common leading run of two token tuples."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

"""Radix prefix cache over the paged KV pool (page-granular sharing).

Each tree node stands for one page of tokens: its key is the page's ``page_size`` token ids (a
leaf may hold a sequence's last, partial page: a shorter key), its path from the root is the
whole prefix, and it holds one reference on its KV page. A new request walks the tree with its
prompt and borrows (retains) the pages of the longest matching prefix, copying a partially
matching page; a finished request inserts its pages. Nodes that no request uses (page refcount 1,
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

    def diverges(self, tokens: list[int], matched: int) -> bool:
        """Whether a cached path shares ``tokens[:matched]`` and then goes on differently: the
        prompt edited a sequence the tree has (an agent rewrote its context), rather than only
        extending it. ``matched`` is match_prefix's length."""
        if matched >= len(tokens):
            return False
        node, ps = self.root, self.ps
        for i in range(matched // ps):
            child = node.children.get(tuple(tokens[i * ps : (i + 1) * ps]))
            if child is None:
                return False
            node = child
        rows = matched % ps
        head = tuple(tokens[matched - rows : matched])
        return any(len(k) > rows and k[:rows] == head for k in node.children)

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Adds a sequence's pages (``pages[i]`` holds tokens of page i). Pages the tree takes are
        retained; where the tree already has that prefix its own page is kept. A last, partial
        page becomes a leaf with a short key: the next turn of an agent resumes at the end of this
        prompt, usually inside that page. Tree pages are never written again (a request copies a
        partial page before writing), so a short-keyed page stays valid."""
        node, now = self.root, next(self._clock)
        ps = self.ps
        n = min(-(-len(tokens) // ps), len(pages))
        for i in range(n):
            key = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                if any(k[: len(key)] == key for k in node.children):
                    return  # a page already there holds these rows (and more)
                self._drop_covered(node, key)
                child = _Node(key, pages[i], node)
                node.children[key] = child
                self.pool.retain([pages[i]])
                self.num_nodes += 1
            child.last_access = now
            node = child

    def _drop_covered(self, node: _Node, key: tuple[int, ...]) -> None:
        """Removes partial-page leaves of ``node`` whose rows ``key`` repeats (held by the tree
        alone: a request only borrows a partial page to copy it)."""
        for k, child in list(node.children.items()):
            if len(k) < len(key) and key[: len(k)] == k and not child.children:
                del node.children[k]
                self.pool.free([child.page])
                self.num_nodes -= 1

    def evictable(self) -> int:
        return sum(1 for n in self._nodes() if not n.children and self.pool.refcount(n.page) == 1)

    def evict(self, n_pages: int) -> int:
        """Frees up to ``n_pages`` pages held by the tree alone, oldest leaves first."""
        freed = 0
        while freed < n_pages:
            leaves = [
                n for n in self._nodes() if not n.children and self.pool.refcount(n.page) == 1
            ]
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

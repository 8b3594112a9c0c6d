"""`ApproxPrefixTree`: which worker has served which text, as a character radix tree.

The tree is approximate on purpose: it records the text a router sent to each worker, not
what the worker's radix cache holds now (the worker may have evicted it, and counts tokens, not
characters). It answers one question — which workers have served the longest prefix of this
text — well enough to send requests that share a prefix to the worker whose cache likely holds
it (SGLang's router keeps the same kind of tree).

Each node holds an edge label (a string) and, per worker, when that worker last used the node.
A worker's size is the number of characters of the edges it holds; `insert` evicts a worker's
least recently used leaves once its size passes `max_chars`, down to `EVICT_TO` of it, so the
cost of an eviction is paid once per many inserts. The tree is not thread-safe: its owner
serializes calls (the router's event loop, the data-parallel client's lock).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

EVICT_TO = 0.75  # an eviction brings a worker down to this fraction of max_chars


@dataclass(eq=False)
class _Node:
    label: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first character -> child
    used: dict[str, int] = field(default_factory=dict)  # worker -> last-use tick


@dataclass(frozen=True)
class PrefixMatch:
    """`matched` characters of the text are a prefix some worker served; `workers` served it."""

    matched: int
    workers: frozenset[str]


class ApproxPrefixTree:
    def __init__(self, max_chars: int):
        if max_chars < 1:
            raise ValueError(f"max_chars must be at least 1, got {max_chars}")
        self.max_chars = max_chars
        self._root = _Node("", None)
        self._sizes: dict[str, int] = {}
        self._tick = itertools.count(1)

    def size(self, worker: str) -> int:
        """Characters of text the tree holds for `worker` (0 for an unknown one)."""
        return self._sizes.get(worker, 0)

    def insert(self, text: str, worker: str) -> None:
        """Record that `worker` served `text` (every prefix of it), then evict if it is over."""
        tick = next(self._tick)
        node = self._root
        self._sizes.setdefault(worker, 0)
        rest = text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                child = _Node(rest, node)
                node.children[rest[0]] = child
            else:
                common = _common_len(child.label, rest)
                if common < len(child.label):
                    child = self._split(child, common)
            if worker not in child.used:
                self._sizes[worker] += len(child.label)
            child.used[worker] = tick
            rest = rest[len(child.label):]
            node = child
        if self._sizes[worker] > self.max_chars:
            self._evict(worker, int(self.max_chars * EVICT_TO))

    def match(self, text: str) -> PrefixMatch:
        """The longest prefix of `text` in the tree, and the workers that served all of it."""
        node, matched, workers = self._root, 0, frozenset[str]()
        rest = text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            common = _common_len(child.label, rest)
            matched += common
            workers = frozenset(child.used)
            if common < len(child.label):
                break
            rest = rest[common:]
            node = child
        return PrefixMatch(matched, workers)

    def remove_worker(self, worker: str) -> None:
        """Forget everything `worker` served."""
        self._evict(worker, 0)
        self._sizes.pop(worker, None)

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node`'s edge after `at` characters; return the new upper node."""
        assert 0 < at < len(node.label)
        parent = node.parent
        assert parent is not None
        upper = _Node(node.label[:at], parent, used=dict(node.used))
        parent.children[upper.label[0]] = upper
        node.label = node.label[at:]
        node.parent = upper
        upper.children[node.label[0]] = node  # its workers hold as many characters as before
        return upper

    def _evict(self, worker: str, target: int) -> None:
        """Drop `worker` from its least recently used leaves until its size is <= `target`."""
        leaves = [(n.used[worker], id(n), n) for n in self._nodes() if _is_leaf_of(n, worker)]
        heapq.heapify(leaves)
        while leaves and self._sizes.get(worker, 0) > target:
            _, _, node = heapq.heappop(leaves)
            del node.used[worker]
            self._sizes[worker] -= len(node.label)
            parent = node.parent
            if not node.used and not node.children and parent is not None:
                del parent.children[node.label[0]]
            if parent is not None and parent is not self._root and _is_leaf_of(parent, worker):
                heapq.heappush(leaves, (parent.used[worker], id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _is_leaf_of(node: _Node, worker: str) -> bool:
    """`worker` holds `node` and none of its children."""
    return worker in node.used and not any(worker in c.used for c in node.children.values())


def _common_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

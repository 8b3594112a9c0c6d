"""The waiting queue and its ordering policies.

- `fcfs`: arrival order (a retracted request goes back to the front).
- `lpm`: longest cached prefix first, so requests that reuse the cache run while it is warm.
- `dfs-weight`: walk the radix tree depth first, heavier subtrees (more waiting requests) first,
  so the siblings of a fork are admitted together.

Aging designs out the starvation of `lpm` / `dfs-weight` (SGLang's known flaw): a request that
has waited `max_wait_steps` scheduling steps is placed ahead of every request that has not, in
arrival order, however many cached requests keep arriving. Aged requests are therefore admitted
within a bounded number of steps once memory allows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from arborlm.radix_cache.base import PrefixCache
from arborlm.runtime.config import SchedulePolicy, choices
from arborlm.runtime.request import Req

DEFAULT_MAX_WAIT_STEPS = 32


class WaitingQueue:
    def __init__(self, policy: str, cache: PrefixCache,
                 max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS):
        if policy not in choices(SchedulePolicy):
            raise ValueError(f"unknown schedule policy {policy!r}")
        self.policy = policy
        self.cache = cache
        self.max_wait_steps = max_wait_steps
        self._reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self):
        return iter(self._reqs)

    def add(self, req: Req, front: bool = False) -> None:
        if front:
            self._reqs.insert(0, req)
        else:
            self._reqs.append(req)

    def remove(self, reqs: Iterable[Req]) -> None:
        gone = {id(r) for r in reqs}
        if gone:
            self._reqs = [r for r in self._reqs if id(r) not in gone]

    def find(self, rid: str) -> Req | None:
        return next((r for r in self._reqs if r.rid == rid), None)

    def tick(self) -> None:
        """One scheduling step passed for every request still waiting."""
        for r in self._reqs:
            r.wait_steps += 1

    def ordered(self) -> list[Req]:
        """Candidates in admission order."""
        if self.policy == "fcfs" or len(self._reqs) <= 1:
            return list(self._reqs)
        aged = [r for r in self._reqs if r.wait_steps >= self.max_wait_steps]
        fresh = [r for r in self._reqs if r.wait_steps < self.max_wait_steps]
        if self.policy == "lpm":
            fresh = self._by_prefix_len(fresh)
        else:
            fresh = self._by_tree_weight(fresh)
        return aged + fresh

    def _match_len(self, req: Req) -> int:
        return len(self.cache.match_prefix(req.fill_ids, req.extra_key).slots)

    def _by_prefix_len(self, reqs: list[Req]) -> list[Req]:
        # sorted() is stable: ties keep arrival order.
        return sorted(reqs, key=lambda r: -self._match_len(r))

    def _by_tree_weight(self, reqs: list[Req]) -> list[Req]:
        """Depth-first over the tree nodes where requests' cached prefixes end."""
        by_node: dict[int, list[Req]] = {}
        nodes: dict[int, Any] = {}
        for r in reqs:
            node = self.cache.match_prefix(r.fill_ids, r.extra_key).node
            by_node.setdefault(id(node), []).append(r)
            nodes[id(node)] = node
        weight: dict[int, int] = {}
        for key, rs in by_node.items():
            node = nodes[key]
            while node is not None:  # every ancestor counts the requests below it
                weight[id(node)] = weight.get(id(node), 0) + len(rs)
                node = getattr(node, "parent", None)
        roots = [n for n in nodes.values() if getattr(n, "parent", None) is None]
        roots += [_root_of(n) for n in nodes.values()]
        out: list[Req] = []
        seen: set[int] = set()
        for root in sorted({id(r): r for r in roots}.values(), key=lambda n: -weight.get(id(n), 0)):
            self._dfs(root, weight, by_node, out, seen)
        return out

    def _dfs(self, node: Any, weight: dict[int, int], by_node: dict[int, list[Req]],
             out: list[Req], seen: set[int]) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            out.extend(by_node.get(id(n), []))
            children = [c for c in getattr(n, "children", {}).values() if id(c) in weight]
            children.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(children)


def _root_of(node: Any) -> Any:
    while getattr(node, "parent", None) is not None:
        node = node.parent
    return node

"""Routing policies: which worker (an engine replica or an HTTP server) gets the next request.

Three policies behind one interface, chosen by name (`create_policy`), with SGLang's names:

- `round_robin`: each worker in turn.
- `shortest_queue`: the worker with the fewest requests in flight (ties: the first listed).
- `cache_aware` (SGLang's router algorithm): while the load is balanced, the worker that has
  served the longest prefix of the request's text (an `ApproxPrefixTree` per policy) when that
  prefix covers more than `cache_threshold` of the text, else the worker that has served the
  least text (the most room in its cache); when the load is imbalanced — the busiest worker has
  more than `balance_abs_threshold` requests above the idlest *and* more than
  `balance_rel_threshold` times its count — the worker with the fewest requests in flight.

A policy sees only names and in-flight counts (`loads`: worker -> requests in flight, in the
caller's order); it never sends anything, tracks no health, and is not thread-safe (its owner
serializes calls). The text routed on is whatever the caller chooses: the prompt text, or token
ids mapped to characters (`ids_text`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from arborlm.routing.prefix_tree import ApproxPrefixTree


class PolicyName(enum.StrEnum):
    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"
    SHORTEST_QUEUE = "shortest_queue"


# SGLang's `--load-balance-method` values and the policy each maps to.
SGLANG_METHODS = {"round_robin": PolicyName.ROUND_ROBIN,
                  "shortest_queue": PolicyName.SHORTEST_QUEUE,
                  "minimum_tokens": PolicyName.SHORTEST_QUEUE,
                  "cache_aware": PolicyName.CACHE_AWARE}


@dataclass(frozen=True)
class CacheAwareConfig:
    """The cache-aware policy's knobs, with SGLang router's names and defaults."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 1 << 24  # characters per worker

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0, got "
                             f"{self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1, got "
                             f"{self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {self.max_tree_size}")


class RoutingPolicy(abc.ABC):
    @abc.abstractmethod
    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        """The worker for a request with `text`, among `loads`' keys (at least one)."""

    def remove_worker(self, worker: str) -> None:  # noqa: B027 - stateless policies keep none
        """Forget what the policy knows about `worker` (it left the rotation)."""


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        workers = _names(loads)
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker


class ShortestQueue(RoutingPolicy):
    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        return _least_loaded(_names(loads), loads)


class CacheAware(RoutingPolicy):
    def __init__(self, config: CacheAwareConfig | None = None):
        self.config = config or CacheAwareConfig()
        self.tree = ApproxPrefixTree(self.config.max_tree_size)

    def choose(self, text: str, loads: Mapping[str, int]) -> str:
        workers = _names(loads)
        if self.imbalanced(loads):
            worker = _least_loaded(workers, loads)
        else:
            match = self.tree.match(text)
            cached = [w for w in workers if w in match.workers]
            if cached and match.matched > self.config.cache_threshold * len(text):
                worker = _least_loaded(cached, loads)
            else:
                worker = min(workers, key=self.tree.size)
        self.tree.insert(text, worker)
        return worker

    def imbalanced(self, loads: Mapping[str, int]) -> bool:
        busiest, idlest = max(loads.values()), min(loads.values())
        return (busiest - idlest > self.config.balance_abs_threshold
                and busiest > idlest * self.config.balance_rel_threshold)

    def remove_worker(self, worker: str) -> None:
        self.tree.remove_worker(worker)


def create_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> RoutingPolicy:
    """The policy named `name` (a `PolicyName` or one of SGLang's `SGLANG_METHODS`)."""
    kind = SGLANG_METHODS.get(name)
    if kind is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of "
                         f"{', '.join(SGLANG_METHODS)}")
    if kind == PolicyName.CACHE_AWARE:
        return CacheAware(cache_aware)
    return RoundRobin() if kind == PolicyName.ROUND_ROBIN else ShortestQueue()


def ids_text(token_ids: Sequence[int]) -> str:
    """Token ids as a string, one character per id, so that id prefixes are string prefixes."""
    return "".join(chr(i % 0x110000) for i in token_ids)


def _names(loads: Mapping[str, int]) -> list[str]:
    if not loads:
        raise ValueError("no worker to route to")
    return list(loads)


def _least_loaded(workers: Sequence[str], loads: Mapping[str, int]) -> str:
    return min(workers, key=lambda w: loads[w])

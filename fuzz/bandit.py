"""Where a campaign spends its time: a bandit over (kernel, dtype), input kind and
config slot, rewarded by the budget used (worst error / bound) a run reached.

A flat bandit over every (kernel, dtype, kind, config) would need hundreds of
pulls before it could prefer anything, so the choice is made level by level with
UCB1: first the (kernel, dtype) pair, then the input kind within the pair, then the
config slot within the pair. A pair starts with one kind ("any": unpinned) and one
slot (None: drawn); after its first run the worker reports the kinds its strategies
offer and the size of its config space, and the levels below it open up.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

# UCB1's exploration weight for rewards in [0, 1]. Budgets of a sound kernel sit
# around 0.01-0.5, so sqrt(2) (the textbook weight for a reward range of 1) would
# drown the differences between arms; 0.5 keeps a pull of every arm within a few
# dozen rounds while a climbing arm is preferred.
EXPLORATION = 0.5
MAX_SLOTS = 8  # config slots opened per pair: the spaces are ordered, the first few differ most


@dataclasses.dataclass
class Stat:
    pulls: int = 0
    total: float = 0.0
    best: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.pulls if self.pulls else 0.0


def reward(budgets: dict[str, float | None]) -> float:
    """The run's worst budget used, capped at 1 (a failure; an infinite budget is
    reported as None)."""
    used = [1.0 if b is None else b for b in budgets.values()]
    return min(max(used, default=0.0), 1.0)


# An arm's statistics key: ("pair", kernel, dtype), ("kind", kernel, dtype, kind) or
# ("slot", kernel, dtype, config slot or None)
StatKey = tuple[str | int | None, ...]


class Bandit:
    def __init__(self, pairs: Sequence[tuple[str, str]], rng: random.Random):
        self.rng = rng
        self.stats: dict[StatKey, Stat] = {}
        self.kinds: dict[tuple[str, str], list[str]] = {p: ["any"] for p in pairs}
        self.slots: dict[tuple[str, str], list[int | None]] = {p: [None] for p in pairs}

    def _stat(self, key: StatKey) -> Stat:
        return self.stats.setdefault(key, Stat())

    def _ucb(self, keys: Sequence[StatKey], parent_pulls: int) -> int:
        def score(key: StatKey) -> float:
            s = self.stats.get(key)
            if s is None or s.pulls == 0:
                return math.inf
            return s.mean + EXPLORATION * math.sqrt(math.log(max(parent_pulls, 1)) / s.pulls)

        scores = [score(k) for k in keys]
        top = max(scores)
        return self.rng.choice([i for i, s in enumerate(scores) if s == top])

    def choose(self, pairs: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], str, int | None]:
        """(pair, kind, slot) among ``pairs`` (the ones not retired)."""
        total = sum(self._stat(("pair",) + p).pulls for p in pairs)
        pair = pairs[self._ucb([("pair",) + p for p in pairs], total)]
        pulls = self._stat(("pair",) + pair).pulls
        kinds, slots = self.kinds[pair], self.slots[pair]
        kind = kinds[self._ucb([("kind",) + pair + (k,) for k in kinds], pulls)]
        slot = slots[self._ucb([("slot",) + pair + (s,) for s in slots], pulls)]
        return pair, kind, slot

    def update(self, pair: tuple[str, str], kind: str, slot: int | None, value: float) -> None:
        for key in (("pair",) + pair, ("kind",) + pair + (kind,), ("slot",) + pair + (slot,)):
            s = self._stat(key)
            s.pulls += 1
            s.total += value
            s.best = max(s.best, value)

    def learn(self, pair: tuple[str, str], kinds: Sequence[str], configs: int) -> None:
        """Open the kind and slot levels of ``pair`` once its strategies are known."""
        if kinds and self.kinds[pair] == ["any"]:
            self.kinds[pair] = ["any", *sorted(kinds)]
        if configs > 1 and self.slots[pair] == [None]:
            self.slots[pair] = [None, *range(min(configs, MAX_SLOTS))]

    def arms(self) -> list[dict[str, Any]]:
        """Every opened (pair, kind) and (pair, slot) arm with its statistics, for the state file."""
        rows = []
        for (target, dtype), kinds in self.kinds.items():
            for level, options in (("kind", kinds), ("slot", self.slots[(target, dtype)])):
                for option in options:
                    s = self.stats.get((level, target, dtype, option), Stat())
                    rows.append(
                        {
                            "kernel": target,
                            "dtype": dtype,
                            "level": level,
                            "option": option,
                            "pulls": s.pulls,
                            "mean_reward": s.mean,
                            "best_budget": s.best,
                        }
                    )
        return rows

    def state(self) -> dict[str, Any]:
        return {
            "stats": [[list(k), dataclasses.asdict(s)] for k, s in self.stats.items()],
            "kinds": [[list(p), k] for p, k in self.kinds.items()],
            "slots": [[list(p), s] for p, s in self.slots.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take the statistics of a saved campaign for the pairs this one has."""
        for key, stat in state.get("stats", []):
            self.stats[tuple(key)] = Stat(**stat)
        for pair, kinds in state.get("kinds", []):
            if tuple(pair) in self.kinds:
                self.kinds[tuple(pair)] = kinds
        for pair, slots in state.get("slots", []):
            if tuple(pair) in self.slots:
                self.slots[tuple(pair)] = slots

"""Engines time-sharing one set of cores, for the fleet simulation.

Several workers pinned to the same cores (`pdserve up` with more workers than cores in a
pool) each run their own engine, and the operating system shares the cores between the
processes that have work. Drawn as processor sharing: a step costs the seconds it would
take alone (its work), and while n engines of the set are in a step each advances at 1/n
of that speed. An idle engine takes nothing. Every start or end of a step changes n, and
with it when every other step in flight ends: the caller re-times those.
"""

from __future__ import annotations


class SharedCores:
    """The steps in flight on one set of cores: the work each has left."""

    def __init__(self) -> None:
        self._left: dict[int, float] = {}  # engine -> seconds of work left, alone
        self._at = 0.0  # when ``_left`` was last brought up to date

    def __len__(self) -> int:
        return len(self._left)

    def _advance(self, now: float) -> None:
        if self._left:
            done = (now - self._at) / len(self._left)
            for engine in self._left:
                self._left[engine] -= done
        self._at = now

    def ends(self, now: float) -> dict[int, float]:
        """When each step in flight ends if no step starts or ends before."""
        n = len(self._left)
        return {e: now + max(0.0, left) * n for e, left in self._left.items()}

    def start(self, engine: int, now: float, work_s: float) -> dict[int, float]:
        """``engine`` starts a step of ``work_s`` seconds alone; returns every step's end."""
        if engine in self._left:
            raise ValueError(f"engine {engine} already has a step in flight")
        self._advance(now)
        self._left[engine] = work_s
        return self.ends(now)

    def finish(self, engine: int, now: float) -> dict[int, float]:
        """``engine``'s step ended; returns the new ends of the others."""
        self._advance(now)
        self._left.pop(engine, None)
        return self.ends(now)

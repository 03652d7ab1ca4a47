"""Which replica of one model a request goes to.

Two policies over the same replicas (base URLs), both skipping a replica that is cooling down
after a failure:

* ``least-loaded``: the healthy replica with the fewest requests in flight (ties rotate).
* ``affinity``: bounded-load consistent hashing (Mirrokni, Thorup and Zadimoghaddam, "Consistent
  Hashing with Bounded Loads", 2018). A request carries a key (the OpenAI backend uses a digest
  of the conversation's first image); the key's place on a hash ring gives each key its own
  order of preference over the replicas, and the request goes to the first replica in that
  order whose load is below ``ceil(load_factor * (requests in flight + 1) / healthy
  replicas)``. Calls with one key therefore land on one replica (whose prefix and encoder
  caches hold that image) unless it is already carrying more than its share, so one hot key
  cannot take a replica over.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Routing = Literal["affinity", "least-loaded"]
ROUTINGS: tuple[str, ...] = ("affinity", "least-loaded")
# A replica takes at most 25 % more than the mean load before a key moves on (the paper's 1+eps).
AFFINITY_LOAD_FACTOR = 1.25
# Points per replica on the ring: enough for an even share of keys with a handful of replicas.
RING_POINTS = 64


@dataclass
class Replica:
    url: str
    client: Any  # openai.AsyncOpenAI
    inflight: int = 0
    served: int = 0
    failures: int = 0  # consecutive
    total_failures: int = 0
    down_until: float = 0.0
    # What its start-up check found (None: not checked, or not reported by the server).
    max_model_len: int | None = None
    finite_logprobs: int | None = None

    def healthy(self, now: float) -> bool:
        return self.down_until <= now


def digest(data: str | bytes) -> int:
    """A stable 64-bit hash (the same in every process, unlike ``hash``)."""
    raw = data.encode() if isinstance(data, str) else data
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


class Router:
    """Picks a replica for each request under one of ``ROUTINGS``."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        routing: Routing = "affinity",
        load_factor: float = AFFINITY_LOAD_FACTOR,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; use one of {', '.join(ROUTINGS)}")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.replicas = list(replicas)
        self.routing = routing
        self.load_factor = load_factor
        self._tie = 0
        # The ring: RING_POINTS points per replica, named by its position so that two replicas
        # with the same URL still get points of their own.
        points = sorted(
            (digest(f"{i}\0{r.url}\0{p}"), i)
            for i, r in enumerate(self.replicas)
            for p in range(RING_POINTS)
        )
        self._ring_keys = [h for h, _ in points]
        self._ring_owners = [i for _, i in points]

    def preference(self, key: int) -> Iterator[Replica]:
        """Every replica once, in the order the ring gives ``key``."""
        n = len(self.replicas)
        start = bisect.bisect_left(self._ring_keys, key)
        seen: set[int] = set()
        for step in range(len(self._ring_owners)):
            owner = self._ring_owners[(start + step) % len(self._ring_owners)]
            if owner not in seen:
                seen.add(owner)
                yield self.replicas[owner]
                if len(seen) == n:
                    return

    def pick(self, key: int | None = None) -> Replica:
        now = time.monotonic()
        healthy = [r for r in self.replicas if r.healthy(now)]
        if not healthy:
            return min(self.replicas, key=lambda r: r.down_until)
        if key is None or self.routing == "least-loaded" or len(self.replicas) == 1:
            least = min(r.inflight for r in healthy)
            tied = [r for r in healthy if r.inflight == least]
            self._tie += 1
            return tied[self._tie % len(tied)]
        load = sum(r.inflight for r in healthy)
        bound = math.ceil(self.load_factor * (load + 1) / len(healthy))
        for r in self.preference(key):
            if r.healthy(now) and r.inflight < bound:
                return r
        return min(healthy, key=lambda r: r.inflight)  # unreachable: some replica is below

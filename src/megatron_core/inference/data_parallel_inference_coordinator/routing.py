"""Which engine gets a request: the coordinator's load and prefix-affinity bookkeeping.

Engines are numbered in the order they registered (sorted by identity in deterministic mode).
Without prefix caching, and with the ``load_balanced`` policy, a request goes to the engine with
the fewest requests in flight (the lowest number on a tie), which for a burst of requests is
round-robin. With prefix caching, each engine is scored
``alpha * match + (1 - alpha) * free_slots / max_requests``, where ``match`` says how deep the
request's prompt-block hashes reach into the hashes already routed to that engine
(``first_prefix_block`` looks at the first block only, so ``match`` is 0 or 1;
``longest_prefix`` uses the deepest shared block over the number of blocks); ties go to the
engine that received the matching block most recently, then to the lowest number.
"""

from __future__ import annotations

from megatron_core.inference.config import PrefixCachingCoordinatorPolicy

__all__ = ["EngineRouter"]


class EngineRouter:
    """In-flight counts and routed block hashes of the connected engines (ZMQ identities)."""

    def __init__(self, max_requests: int, policy: PrefixCachingCoordinatorPolicy, alpha: float,
                 enable_prefix_caching: bool) -> None:
        self.max_requests = max_requests
        self.policy = PrefixCachingCoordinatorPolicy(policy)
        self.alpha = alpha
        self.enable_prefix_caching = enable_prefix_caching
        self.identities: list[bytes] = []
        self.pending: dict[bytes, int] = {}
        self._hash_owners: dict[int, dict[bytes, int]] = {}  # block hash -> {engine: assignment stamp}
        self._stamp = 0

    def add(self, identity: bytes) -> bool:
        """Register an engine; ``False`` if it was already registered."""
        if identity in self.pending:
            return False
        self.identities.append(identity)
        self.pending[identity] = 0
        return True

    def remove(self, identity: bytes) -> None:
        """Forget an engine and every hash routed to it."""
        if identity not in self.pending:
            return
        self.identities.remove(identity)
        del self.pending[identity]
        for owners in self._hash_owners.values():
            owners.pop(identity, None)
        self._hash_owners = {h: owners for h, owners in self._hash_owners.items() if owners}

    def sort(self) -> None:
        """Number the engines by identity (deterministic mode)."""
        self.identities.sort()

    def least_loaded(self) -> bytes:
        """The engine with the fewest requests in flight (lowest number on a tie)."""
        if not self.identities:
            raise RuntimeError("no inference engine is connected to the coordinator")
        return min(self.identities, key=lambda ident: self.pending[ident])

    def uses_hashes(self) -> bool:
        """Whether routing reads the requests' prompt-block hashes."""
        return self.enable_prefix_caching and self.policy != PrefixCachingCoordinatorPolicy.LOAD_BALANCED

    def best(self, hashes: list[int]) -> bytes:
        """The engine for a request with prompt-block ``hashes`` (see the module docstring)."""
        if not self.uses_hashes() or not hashes:
            return self.least_loaded()
        if self.policy == PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK:
            hashes = hashes[:1]
        match = dict.fromkeys(self.identities, 0.0)
        recency = dict.fromkeys(self.identities, 0)
        for depth in range(len(hashes) - 1, -1, -1):
            owners = self._hash_owners.get(hashes[depth])
            if owners:
                for ident, stamp in owners.items():
                    match[ident] = (depth + 1) / len(hashes)
                    recency[ident] = stamp
                break

        def score(index_ident: tuple[int, bytes]) -> tuple[float, int, int]:
            index, ident = index_ident
            free = max(0, self.max_requests - self.pending[ident]) / self.max_requests
            return (-(self.alpha * match[ident] + (1.0 - self.alpha) * free), -recency[ident], index)

        if not self.identities:
            raise RuntimeError("no inference engine is connected to the coordinator")
        return min(enumerate(self.identities), key=score)[1]

    def assign(self, identity: bytes, hashes: list[int]) -> None:
        """Book a request (with prompt-block ``hashes``) as routed to ``identity``."""
        self.pending[identity] += 1
        if self.uses_hashes() and hashes:
            if self.policy == PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK:
                hashes = hashes[:1]
            self._stamp += 1
            for block_hash in hashes:
                self._hash_owners.setdefault(block_hash, {})[identity] = self._stamp

    def finish(self, identity: bytes) -> None:
        """Book one of ``identity``'s requests as finished."""
        if self.pending.get(identity, 0) > 0:
            self.pending[identity] -= 1

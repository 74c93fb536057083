"""A tier in memory: GPU memory (the device tier) or host RAM (the host tier).

Entries live as tensors on the tier's torch device. Eviction follows the tier's policy and never
takes a pinned key; victims are handed back to the store, which demotes them. This module does not
copy tensors between tiers on its own, use page-locked host buffers, or overlap copies with compute.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .entry import Entry, EntryTooLargeError, TierFullError
from .policies import DEFAULT_POLICY, make_policy
from .tier import Arrival, Tier


class MemoryTier(Tier):
    """Entries as tensors on `device`, within `budget_bytes` of tensor data.

    Inserted entries are moved to `device` (a no-op when they are there already; the store copies
    on put so callers never share storage with it). Entries returned by `get` share storage with
    the tier: treat them as read-only.
    """

    def __init__(
        self,
        name: str,
        device: torch.device | str,
        budget_bytes: int,
        policy: str = DEFAULT_POLICY,
    ) -> None:
        super().__init__(name, budget_bytes)
        self.device = torch.device(device)
        self._policy = make_policy(policy)
        self._entries: dict[str, Entry] = {}
        self._bytes = 0

    @property
    def bytes_in_use(self) -> int:
        return self._bytes

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.counters.misses += 1
            return None
        self._policy.touch(key)
        self.counters.hits += 1
        self.counters.bytes_read += entry.nbytes
        return entry

    def insert(self, key: str, entry: Entry, arrived: Arrival) -> list[tuple[str, Entry]]:
        nbytes = entry.nbytes
        if not self.fits(nbytes):
            raise EntryTooLargeError(key, nbytes, {self.name: self.budget_bytes})
        if not self.can_admit(key, nbytes):
            raise TierFullError(
                f"tier {self.name!r}: pinned entries leave no room for {nbytes} more bytes "
                f"within {self.budget_bytes}"
            )
        previous = self._entries.get(key)
        held = self._bytes - (previous.nbytes if previous is not None else 0)
        self.pop(key)
        evicted: list[tuple[str, Entry]] = []
        while held + nbytes > self.budget_bytes:
            victim = self._policy.victim(keep=self.pinned)
            if victim is None:  # unreachable after the pinned-bytes check; guards a broken policy
                raise TierFullError(f"tier {self.name!r}: policy found no victim")
            gone = self.pop(victim)
            if gone is None:
                raise RuntimeError(f"tier {self.name!r}: policy named {victim!r}, which is not held")
            held -= gone.nbytes
            self.counters.evictions += 1
            evicted.append((victim, gone))
        self._entries[key] = entry.to(self.device)
        self._bytes += nbytes
        self._policy.admit(key, nbytes)
        self._count_arrival(arrived, nbytes)
        return evicted

    def can_admit(self, key: str, nbytes: int) -> bool:
        """Whether `insert` of `nbytes` under `key` would succeed (budget and pins allowing)."""
        pinned_bytes = sum(e.nbytes for k, e in self._entries.items() if k in self.pinned and k != key)
        return pinned_bytes + nbytes <= self.budget_bytes

    def peek(self, key: str) -> Entry | None:
        """The entry under `key` without counting or touching its recency."""
        return self._entries.get(key)

    def remove(self, key: str) -> bool:
        return self.pop(key) is not None

    def pop(self, key: str) -> Entry | None:
        """Take `key` out without counting an eviction and return its entry (None if absent)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._policy.forget(key)
        return entry

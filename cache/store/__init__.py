"""The content-addressed KV store: entries of named tensors in device, host and disk tiers, and
optionally a Redis tier shared by many replicas (`redis_tier`).

Build one with `TieredStore.from_config(StoreConfig(...))`, or from tiers for tests. Keys are
content hashes made by the caller; sub-records of a chunk use `record_key`. See `tiered` for how
entries move between tiers, `disk` for the on-disk format and multi-process rules, and `stats` for
the counters.
"""

from __future__ import annotations

from .disk import DiskTier
from .entry import Entry, EntryTooLargeError, TierFullError, record_key, validate_key
from .memory import MemoryTier
from .policies import EvictionPolicy, available_policies, make_policy, register_policy
from .redis_tier import RedisConfig, RedisHealth, RedisTier
from .stats import StatsSource, StoreStats, TierStats
from .tier import Tier
from .tiered import PutResult, StoreConfig, TieredStore

__all__ = [
    "DiskTier",
    "Entry",
    "EntryTooLargeError",
    "EvictionPolicy",
    "MemoryTier",
    "PutResult",
    "RedisConfig",
    "RedisHealth",
    "RedisTier",
    "StatsSource",
    "StoreConfig",
    "StoreStats",
    "Tier",
    "TierFullError",
    "TierStats",
    "TieredStore",
    "available_policies",
    "make_policy",
    "record_key",
    "register_policy",
    "validate_key",
]

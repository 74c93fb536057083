"""The content-addressed KV store: entries of named tensors in device, host and disk tiers, and
optionally a Redis tier shared by many replicas (`redis_tier`).

Build one with `TieredStore.from_config(StoreConfig(...))`, or from tiers for tests. Keys are
content hashes made by the caller; sub-records of a chunk use `record_key`. Entries certify
themselves (`entry.certify`, `codec`): a hit from any tier that names another key or other tokens
is refused. See `tiered` for how entries move between tiers, `disk` for the on-disk layout and
multi-process rules, `recovery` for repairing a directory, and `stats` for the counters.
"""

from __future__ import annotations

from .codec import CorruptEntryError, decode_entry, encode_entry
from .disk import DiskTier
from .entry import (
    Entry,
    EntryTooLargeError,
    MisfiledEntryError,
    TierFullError,
    certify,
    record_key,
    validate_key,
)
from .memory import MemoryTier
from .policies import EvictionPolicy, available_policies, make_policy, register_policy
from .recovery import Report, scan
from .redis_tier import RedisConfig, RedisHealth, RedisTier
from .stats import StatsSource, StoreStats, TierStats
from .tier import Tier
from .tiered import PutResult, StoreConfig, TieredStore

__all__ = [
    "CorruptEntryError",
    "DiskTier",
    "Entry",
    "EntryTooLargeError",
    "EvictionPolicy",
    "MemoryTier",
    "MisfiledEntryError",
    "PutResult",
    "RedisConfig",
    "RedisHealth",
    "RedisTier",
    "Report",
    "StatsSource",
    "StoreConfig",
    "StoreStats",
    "Tier",
    "TierFullError",
    "TierStats",
    "TieredStore",
    "available_policies",
    "certify",
    "decode_entry",
    "encode_entry",
    "make_policy",
    "record_key",
    "register_policy",
    "scan",
    "validate_key",
]

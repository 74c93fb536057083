"""A tiered store's configuration, and where a put landed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .policies import DEFAULT_POLICY, available_policies
from .redis_tier import RedisConfig


@dataclass(frozen=True)
class StoreConfig:
    """Budgets and choices of a store built by `TieredStore.from_config`.

    device: torch device of the device tier; None picks "cuda" when available. Without CUDA (or
        with a CPU device) there is no device tier and `device_bytes` is ignored: the tensors in
        use are host memory, already counted by `host_bytes`.
    disk_path: folder of the disk tier (shared by every process pointing at it); None: no disk tier.
    policy: eviction policy name for every tier, see `available_policies()`.
    write_through: also write every put to disk (needed for other processes, or a restart, to see it).
    write_queue: disk writes waiting for the background writer, at most; 0 writes in the caller.
    durable: fsync every disk write.
    redis: the shared tier below the local ones (see `RedisConfig`); None: no shared tier.
    """

    host_bytes: int
    device_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | Path | None = None
    device: str | None = None
    policy: str = DEFAULT_POLICY
    write_through: bool = False
    write_queue: int = 256
    durable: bool = True
    redis: RedisConfig | None = None

    def __post_init__(self) -> None:
        for name in ("host_bytes", "device_bytes", "disk_bytes", "write_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.policy not in available_policies():
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose from {available_policies()}")
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("disk_path and a positive disk_bytes go together")
        if self.write_through and self.disk_path is None:
            raise ValueError("write_through needs a disk tier")


class PutResult(NamedTuple):
    """Where a put landed: the fastest tier now holding the entry, and its tensor bytes."""

    tier: str
    nbytes: int

"""The shared tier: entries in Redis (or Valkey) through redis-py, for many replicas at once.

Any replica computes the content keys of its own prompt and asks Redis for them, so one
replica's prefill is another's hit with no shared index. The tier sits below the local ones:

    fetch_many  one MGET for every key a request needs (one round trip), each value verified;
                called on the request's path, bounded by short socket timeouts.
    submit      queue an entry for a background thread that writes it with SET .. EX ttl in
                pipelines; a full queue drops the write (a lost hit later, never a wait now).

A value is the entry's self-certifying bytes, the same the disk tier writes (``codec``:
safetensors, never pickle, with the key, the token fingerprint and a digest inside), checked by
the same ``decode_entry``. A value that is damaged or half-written (``corrupt_dropped``) or that
certifies another key (``misfiled``) is refused, deleted from Redis in the background, and
reported as a miss; the token fingerprint is checked when the store is read (``tiered``).

Faults cost hits, never requests: every Redis error is caught and counted; a circuit breaker
stops asking after a few failures in a row and lets one call through after ``retry_after_s``.
A write Redis refuses (``maxmemory`` reached under ``noeviction``) is counted, not a failure.
Redis's own ``maxmemory`` with ``maxmemory-policy allkeys-lru`` bounds the tier; this module
keeps no budget and evicts nothing.

Not here: deciding which keys a request needs (the prompt cache), placing hits in the local
tiers (``tiered``), tenant separation (the tenant's salt is inside every content key).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from .breaker import CircuitBreaker, State
from .codec import CorruptEntryError, decode_entry, encode_entry
from .entry import Entry, MisfiledEntryError
from .stats import TierCounters, TierStats

_STOP = object()


@dataclass(frozen=True)
class RedisConfig:
    """Where the shared tier is and how it behaves. Raises ValueError on bad values.

    url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS; redis-py parses it).
    cluster: connect with ``RedisCluster`` (keys spread over slots; lookups use MGET per slot).
    key_prefix: prepended to every store key, so one Redis can hold other data beside ours.
    ttl_s: expiry of every write (0: none; then only ``maxmemory`` bounds the tier).
    max_entry_bytes: an encoded entry above this is not written.
    timeout_s / connect_timeout_s: socket timeouts; a slow Redis costs at most this per call.
    failures_to_open / retry_after_s: the circuit breaker.
    queue_entries: writes waiting for the background thread; more are dropped.
    """

    url: str
    cluster: bool = False
    key_prefix: str = "kamera:"
    ttl_s: int = 24 * 3600
    max_entry_bytes: int = 64 << 20
    timeout_s: float = 0.25
    connect_timeout_s: float = 0.25
    failures_to_open: int = 3
    retry_after_s: float = 5.0
    queue_entries: int = 256

    def __post_init__(self) -> None:
        if urlsplit(self.url).scheme not in ("redis", "rediss", "unix", "valkey", "valkeys"):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_s < 0 or self.max_entry_bytes < 1 or self.queue_entries < 1:
            raise ValueError("ttl_s must be >= 0, max_entry_bytes and queue_entries >= 1")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("redis timeouts must be positive")
        if self.failures_to_open < 1 or self.retry_after_s <= 0:
            raise ValueError("failures_to_open must be >= 1 and retry_after_s > 0")

    @property
    def safe_url(self) -> str:
        """The URL without its password (for /health and logs)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))


class RedisHealth(NamedTuple):
    """What /health shows of the tier."""

    url: str
    state: State  # of the breaker: "closed" is healthy
    last_error: str | None
    queued: int  # writes waiting or being written
    writes_dropped: int  # queue full, breaker open, or the write failed
    writes_refused: int  # Redis said no (out of memory) or the entry was over max_entry_bytes


def connect(config: RedisConfig) -> Any:
    """A redis-py client for `config`: short timeouts and no retries (the breaker decides)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if config.cluster:
        return redis.RedisCluster.from_url(config.url, **options)
    return redis.Redis.from_url(config.url, **options)


class RedisTier:
    """The shared tier over a redis-py client (``connect(config)``, or a fakeredis one in tests).

    Thread-safe; owns one background writer thread, started on construction, stopped by `close`.
    """

    name = "redis"

    def __init__(self, client: Any, config: RedisConfig, breaker: CircuitBreaker | None = None) -> None:
        self.client = client
        self.config = config
        self.breaker = breaker or CircuitBreaker(config.failures_to_open, config.retry_after_s)
        self.counters = TierCounters()
        self._lock = threading.Lock()  # counters and the polled server figures
        self.writes = self.writes_dropped = self.writes_refused = 0
        self._server = (0, 0, 0)  # maxmemory, used_memory, dbsize as last polled
        self._queue: queue.Queue[Any] = queue.Queue(config.queue_entries)
        self._writer = threading.Thread(target=self._write_loop, name="kamera-redis-writer", daemon=True)
        self._writer.start()

    @classmethod
    def from_config(cls, config: RedisConfig) -> RedisTier:
        return cls(connect(config), config)

    def _rkey(self, key: str) -> str:
        return self.config.key_prefix + key

    # --- reads, on the request's path ----------------------------------------------------------

    def fetch_many(self, keys: list[str]) -> dict[str, Entry]:
        """The verified entries of `keys` found in Redis, in one round trip; {} if Redis is away."""
        if not keys:
            return {}
        if not self.breaker.allow():
            self._count(misses=len(keys))
            return {}
        rkeys = [self._rkey(k) for k in keys]
        try:
            values = self.client.mget_nonatomic(rkeys) if self.config.cluster else self.client.mget(rkeys)
        except Exception as err:  # redis errors, socket errors, a cluster resharding: all cost hits only
            self.breaker.failure(f"{type(err).__name__}: {err}")
            self._count(misses=len(keys))
            return {}
        self.breaker.success()
        found: dict[str, Entry] = {}
        for key, value in zip(keys, values, strict=True):
            if value is None:
                self._count(misses=1)
                continue
            try:
                found[key] = decode_entry(value, key)
            except (CorruptEntryError, MisfiledEntryError) as err:
                bad = isinstance(err, CorruptEntryError)
                self._count(misses=1, corrupt_dropped=int(bad), misfiled=int(not bad))
                self._enqueue((key, None))  # delete it, so no replica trips on it again
                continue
            self._count(hits=1, bytes_read=len(value))
        return found

    # --- writes, in the background ------------------------------------------------------------

    def submit(self, key: str, entry: Entry) -> bool:
        """Queue `entry` for writing; False (counted) if the queue is full. Never blocks."""
        return self._enqueue((key, entry))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (or dropped); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (for up to `timeout_s`), then stop the writer."""
        self.flush(timeout_s)
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        self._writer.join(timeout_s)

    def _enqueue(self, item: tuple[str, Entry | None]) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            with self._lock:
                self.writes_dropped += 1
            return False

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=min(5.0, self.config.retry_after_s))
            except queue.Empty:
                self._poll_server()
                continue
            batch = [item]
            while len(batch) < 32:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(b is _STOP for b in batch)
            try:
                self._write([b for b in batch if b is not _STOP])
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return

    def _write(self, batch: list[tuple[str, Entry | None]]) -> None:
        """One pipeline of SETs (and DELs of corrupt entries); every error is counted, none raised."""
        ops: list[tuple[str, bytes | None]] = []
        for key, entry in batch:
            if entry is None:
                ops.append((key, None))
                continue
            try:
                value = encode_entry(entry.sealed(key))
            except ValueError:  # sealed with another key: never filed under this one
                value = None
            if value is None or len(value) > self.config.max_entry_bytes:
                with self._lock:
                    self.writes_refused += 1
                continue
            ops.append((key, value))
        if not ops:
            return
        if not self.breaker.allow():
            with self._lock:
                self.writes_dropped += sum(v is not None for _, v in ops)
            return
        ttl = self.config.ttl_s or None
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, value in ops:
                if value is None:
                    pipe.delete(self._rkey(key))
                else:
                    pipe.set(self._rkey(key), value, ex=ttl)
            results = pipe.execute(raise_on_error=False)
        except Exception as err:
            self.breaker.failure(f"{type(err).__name__}: {err}")
            with self._lock:
                self.writes_dropped += sum(v is not None for _, v in ops)
            return
        self.breaker.success()
        with self._lock:
            for (_, value), result in zip(ops, results, strict=True):
                if value is None:
                    continue
                if isinstance(result, Exception):  # OOM under noeviction, or a read-only replica
                    self.writes_refused += 1
                else:
                    self.writes += 1
                    self.counters.bytes_written += len(value)

    def _poll_server(self) -> None:
        """Refresh maxmemory, used memory and key count for the stats, when idle (never on a
        request's path); also the probe that closes the breaker once Redis is back."""
        if self.config.cluster or not self.breaker.allow():
            return
        try:
            info = self.client.info("memory")
            dbsize = int(self.client.dbsize())
        except Exception as err:
            self.breaker.failure(f"{type(err).__name__}: {err}")
            return
        self.breaker.success()
        with self._lock:
            self._server = (int(info.get("maxmemory", 0)), int(info.get("used_memory", 0)), dbsize)

    # --- counters --------------------------------------------------------------------------------

    def _count(
        self, hits: int = 0, misses: int = 0, bytes_read: int = 0, corrupt_dropped: int = 0, misfiled: int = 0
    ) -> None:
        with self._lock:
            c = self.counters
            c.hits += hits
            c.misses += misses
            c.bytes_read += bytes_read
            c.corrupt_dropped += corrupt_dropped
            c.misfiled += misfiled

    def stats(self) -> TierStats:
        """Counters of this replica; budget, bytes in use and entries are the server's whole
        database as last polled (``maxmemory`` 0 means unbounded)."""
        with self._lock:
            budget, used, entries = self._server
            return TierStats.of(self.name, budget, used, entries, TierCounters(**vars(self.counters)))

    def health(self) -> RedisHealth:
        with self._lock:
            dropped, refused = self.writes_dropped, self.writes_refused
        return RedisHealth(
            self.config.safe_url,
            self.breaker.state,
            self.breaker.last_error,
            self._queue.unfinished_tasks,
            dropped,
            refused,
        )

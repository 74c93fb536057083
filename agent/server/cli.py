"""``kamera serve``: the OpenAI-compatible endpoint and agent sessions over HTTP.

The runtime is built from options (or KAMERA_* environment variables), then the app is served
with uvicorn (``serving.py``) until SIGTERM, which drains running requests first, or SIGINT.

Every option has an environment variable: ``--max-body-bytes`` is ``KAMERA_MAX_BODY_BYTES``,
``--port`` is ``KAMERA_PORT``, ``--redis-url`` is ``KAMERA_REDIS_URL``, and so on; an option on
the command line wins. API keys come
from ``--api-keys-file`` (one ``key tenant`` pair a line) or ``KAMERA_API_KEYS``
(``key:tenant,key:tenant``), never from a command line where ``ps`` would show them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.engine.limits import ServerLimits, limit_fields
from agent.modes import (
    DEFAULT_MODE,
    MODE_HELP,
    REPAIR_DEPTH_UNIT,
    REPAIR_MARGIN,
    REPAIR_MARGIN_CAP,
    REPAIR_MAX_RATIO,
    REPAIR_RATIO,
    REPAIR_RESIDUAL_UNIT,
    REUSE_MODES,
)
from cache.numerics import PREFILL_PRODUCTS


def _env(name: str, default: Any) -> Any:
    return os.environ.get("KAMERA_" + name.upper().replace("-", "_"), default)


def _flag(name: str) -> bool:
    return str(_env(name, "")).lower() in ("1", "true", "yes", "on")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kamera serve", description="OpenAI-compatible endpoint with agent sessions"
    )
    p.add_argument(
        "--model", default=_env("model", None), help="embedded name, checkpoint folder or .gguf file"
    )
    p.add_argument("--served-model-name", default=_env("served_model_name", None))
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env("port", 8000))
    p.add_argument("--device", default=_env("device", "cpu"))
    p.add_argument("--dtype", default=_env("dtype", "float32"), choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--prefill-products",
        default=_env("prefill_products", "float32"),
        choices=PREFILL_PRODUCTS,
        help="the dtype prefill passes multiply a text decoder's float32 weights in (bfloat16: "
        "about 1.7x faster prefill on CPUs with bfloat16 dot products, other numerics; decode "
        "steps keep theirs)",
    )
    p.add_argument("--log-level", default=_env("log_level", "info"))
    p.add_argument(
        "--threads", type=int, default=_env("threads", None), help="torch CPU threads (default: torch's)"
    )
    store = p.add_argument_group("store")
    store.add_argument("--host-bytes", type=int, default=_env("host_bytes", 2 << 30))
    store.add_argument("--device-bytes", type=int, default=_env("device_bytes", 0))
    store.add_argument("--disk-path", default=_env("disk_path", None))
    store.add_argument("--disk-bytes", type=int, default=_env("disk_bytes", 0))
    store.add_argument("--store-policy", default=_env("store_policy", "lru"))
    store.add_argument(
        "--reuse-mode",
        default=_env("reuse_mode", DEFAULT_MODE),
        choices=REUSE_MODES,
        help="default reuse of cached KV (a request's kamera_reuse overrides it): "
        + "; ".join(f"{m}: {MODE_HELP[m]}" for m in REUSE_MODES),
    )
    store.add_argument(
        "--repair-ratio",
        type=float,
        default=_env("repair_ratio", str(REPAIR_RATIO)),
        help="repair: the least share of a reused piece's tokens recomputed through every layer, "
        "those whose layer-1 KV deviates most in this context",
    )
    store.add_argument(
        "--repair-max-ratio",
        type=float,
        default=_env("repair_max_ratio", str(REPAIR_MAX_RATIO)),
        help="repair: the share grows up to this while what it leaves calls for a wider guard "
        "margin than --repair-margin (at or below --repair-ratio: no growth)",
    )
    store.add_argument(
        "--repair-margin",
        type=float,
        default=_env("repair_margin", str(REPAIR_MARGIN)),
        help="repair's guard: a greedy step on repaired KV whose best two logits lie closer than this "
        "moves decoding to exact KV (0: no guard)",
    )
    store.add_argument(
        "--repair-residual-unit",
        type=float,
        default=_env("repair_residual_unit", str(REPAIR_RESIDUAL_UNIT)),
        help="repair's guard: the deviation a repair leaves (relative, at layer 1) at which the margin "
        "is as set; it scales with the square root of the ratio, up and down (0: the margin as set)",
    )
    store.add_argument(
        "--repair-margin-cap",
        type=float,
        default=_env("repair_margin_cap", str(REPAIR_MARGIN_CAP)),
        help="repair's guard: a repair whose residual calls for a larger margin is given up and the "
        "prompt prefilled exact at once (0: never)",
    )
    store.add_argument(
        "--repair-depth-unit",
        type=float,
        default=_env("repair_depth_unit", str(REPAIR_DEPTH_UNIT)),
        help="repair's guard: the depth (how the recomputed tokens' deviation grew past layer 1) at "
        "which the margin is the residual's; it scales with the square root of the ratio, up and "
        "down (0: the residual alone)",
    )
    store.add_argument(
        "--repair-must-pay",
        action=argparse.BooleanOptionalAction,
        default=str(_env("repair_must_pay", "true")).lower() not in ("0", "false", "no", "off"),
        help="give a repair up, the prompt prefilled exact at once, where the chance of a close call "
        "at its guard's margin (read from recent answers) makes going on cost more than that "
        "prefill (default on)",
    )
    shared = p.add_argument_group("shared tier (Redis or Valkey, for replicas)")
    shared.add_argument(
        "--redis-url",
        default=_env("redis_url", None),
        help="redis://[user:password@]host:port/db (rediss:// for TLS); unset: no shared tier",
    )
    shared.add_argument(
        "--redis-cluster",
        action="store_true",
        default=_env("redis_cluster", "") in ("1", "true", "yes"),
        help="the URL names a Redis Cluster node",
    )
    shared.add_argument("--redis-ttl-s", type=int, default=_env("redis_ttl_s", 24 * 3600))
    shared.add_argument("--redis-max-entry-bytes", type=int, default=_env("redis_max_entry_bytes", 64 << 20))
    shared.add_argument("--redis-timeout-ms", type=float, default=_env("redis_timeout_ms", 250))
    shared.add_argument(
        "--redis-retry-s",
        type=float,
        default=_env("redis_retry_s", 5),
        help="after Redis fails, wait this long before asking again",
    )
    media = p.add_argument_group("media")
    media.add_argument(
        "--allow-local-dir", default=_env("allow_local_dir", None), help="serve local media from here"
    )
    media.add_argument(
        "--fetch-hosts",
        default=_env("fetch_hosts", ""),
        help="comma-separated hosts whose https images may be fetched (empty: fetching off)",
    )
    p.add_argument("--api-keys-file", default=_env("api_keys_file", None))
    p.add_argument(
        "--public-metrics",
        action="store_true",
        default=_flag("public_metrics"),
        help="/metrics answers without an API key (every other route but /health needs one)",
    )
    p.add_argument(
        "--lenient-fields",
        action="store_true",
        default=_flag("lenient_fields"),
        help="ignore unknown request fields instead of refusing them with 400",
    )
    limits = p.add_argument_group("limits")
    for name, kind, default in limit_fields():
        limits.add_argument("--" + name.replace("_", "-"), type=kind, default=kind(_env(name, default)))
    return p


def api_keys(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    if args.api_keys_file:
        for line in Path(args.api_keys_file).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, _, tenant = line.strip().partition(" ")
                pairs.append((key, tenant.strip() or key[:8]))
    for item in filter(None, os.environ.get("KAMERA_API_KEYS", "").split(",")):
        key, _, tenant = item.partition(":")
        pairs.append((key.strip(), tenant.strip() or key[:8]))
    return tuple(pairs)


def build_config(args: argparse.Namespace) -> Any:
    from agent.engine.media import MediaPolicy
    from agent.engine.prompt_cache import PromptCacheConfig
    from agent.engine.runtime import RuntimeConfig
    from cache.store import RedisConfig, StoreConfig
    from tools.media import FetchConfig

    hosts = frozenset(h.strip() for h in args.fetch_hosts.split(",") if h.strip())
    redis = None
    if args.redis_url:
        redis = RedisConfig(
            url=args.redis_url,
            cluster=args.redis_cluster,
            ttl_s=args.redis_ttl_s,
            max_entry_bytes=args.redis_max_entry_bytes,
            timeout_s=args.redis_timeout_ms / 1000,
            connect_timeout_s=args.redis_timeout_ms / 1000,
            retry_after_s=args.redis_retry_s,
        )
    return RuntimeConfig(
        model=args.model,
        served_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        prefill_products=args.prefill_products,
        limits=ServerLimits(**{name: getattr(args, name) for name, _, _ in limit_fields()}),
        store=StoreConfig(
            host_bytes=args.host_bytes,
            device_bytes=args.device_bytes,
            disk_bytes=args.disk_bytes,
            disk_path=args.disk_path,
            policy=args.store_policy,
            redis=redis,
            write_through=args.disk_path is not None,  # in the background; a restart finds every chunk
        ),
        prompt_cache=PromptCacheConfig(
            mode=args.reuse_mode,
            repair_ratio=args.repair_ratio,
            repair_max_ratio=args.repair_max_ratio,
            repair_margin=args.repair_margin,
            repair_residual_unit=args.repair_residual_unit,
            repair_margin_cap=args.repair_margin_cap,
            repair_depth_unit=args.repair_depth_unit,
            repair_must_pay=args.repair_must_pay,
        ),
        media=MediaPolicy(
            allowed_dir=Path(args.allow_local_dir) if args.allow_local_dir else None,
            fetch=FetchConfig(enabled=bool(hosts), allowed_hosts=hosts),
        ),
        api_keys=api_keys(args),
        lenient_fields=args.lenient_fields,
        public_metrics=args.public_metrics,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from agent.engine.runtime import Runtime
        from agent.server.app import create_app
        from agent.server.logs import configure_logging
        from agent.server.serving import serve
    except ImportError as exc:
        print(f"kamera serve needs the server extra: pip install 'kamera[server]' ({exc})")
        return 2
    configure_logging(args.log_level)
    if args.threads:
        import torch

        torch.set_num_threads(int(args.threads))
    try:
        config = build_config(args)
    except ValueError as exc:
        print(f"kamera serve: {exc}")
        return 2
    try:
        runtime = Runtime.load(config)
    except ValueError as exc:  # a setting the model cannot take (e.g. bfloat16 products on a vision model)
        print(f"kamera serve: {exc}")
        return 2
    serve(create_app(runtime), runtime, args.host, args.port)
    return 0

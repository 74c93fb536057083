"""Content keys: a strong hash of a typed namespace and a chunk's content.

Every field goes into the hash as ``tag | length | bytes`` (one tag byte naming its type, an
8-byte big-endian length), after a domain string naming the key kind, so no two different
field sequences can produce the same byte stream: ``tokens [1, 2] + salt "3"`` and
``tokens [1] + salt "23"`` hash different inputs, and tenants with different salts never share a
key. The hash is BLAKE3 when the ``blake3`` package imports, BLAKE2b-256 otherwise; the name is
part of every key's input, so the two never mix.

Chained keys give prefix semantics: the key of chunk i covers its own key and the chained key
before it, so equal chained keys mean equal whole prefixes.

Content that has no typed key here (a model's weights, the chunk ids of a window, a screenshot)
is hashed with :func:`digest_key`: the same hash, framing and domain, under a ``kind`` of its own.

What this module does not do: store entries or verify hits (``cache/index.py`` keeps the token
ids beside each key and compares them); ``KeyMemo`` only remembers keys it has computed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np
import torch

_blake3: Any
try:
    import blake3 as _blake3

    HASH_NAME = "blake3"
except ImportError:  # pragma: no cover - blake3 is a dependency; the fallback keeps keys strong
    _blake3 = None
    HASH_NAME = "blake2b-256"

DIGEST_SIZE = 32
_DOMAIN = b"kamera.key.v1"
FieldValue = str | bytes | int | float | bool | None | tuple[Any, ...]


def _hasher() -> Any:
    return _blake3.blake3() if _blake3 is not None else hashlib.blake2b(digest_size=DIGEST_SIZE)


def _digest(data: bytes) -> bytes:
    """One-shot hash of ``data`` (what ``_hasher`` gives after one update)."""
    if _blake3 is not None:
        return _blake3.blake3(data).digest()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


_LENGTH = struct.Struct(">Q")


def _frame(tag: bytes, payload: bytes) -> bytes:
    return tag + _LENGTH.pack(len(payload)) + payload


def encode_value(value: FieldValue) -> bytes:
    """One value as ``tag | length | bytes``; tuples nest their encoded items.

    Raises TypeError for other types (a silent ``str()`` would let different values collide).
    """
    if value is None:
        return _frame(b"N", b"")
    if isinstance(value, bool):  # before int: bool is an int subclass
        return _frame(b"?", b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _frame(b"i", value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True))
    if isinstance(value, float):
        return _frame(b"f", struct.pack(">d", value))
    if isinstance(value, str):
        return _frame(b"s", value.encode("utf-8"))
    if isinstance(value, bytes):
        return _frame(b"b", value)
    if isinstance(value, tuple):
        return _frame(b"(", b"".join(encode_value(v) for v in value))
    raise TypeError(f"cannot encode a key field of type {type(value).__name__}")


def encode_fields(fields: Iterable[tuple[str, FieldValue]]) -> bytes:
    """Named fields, each name and value framed, in the given order."""
    return b"".join(encode_value(name) + encode_value(value) for name, value in fields)


@dataclass(frozen=True)
class Namespace:
    """What must match, besides content, for cached KV to be reusable.

    model: fingerprint of the weights (e.g. a checkpoint hash); dtype: KV dtype name;
    layout_version: version of the stored KV layout; tenant_salt: isolates tenants (keys of
    different salts never coincide); adapter: LoRA/adapter name, "" for none; numerics: what the
    KV's bits depend on besides weights and tokens (``cache.numerics.numerics``: torch version,
    BLAS/LAPACK, CPU capability, threads, device, attention implementation), so an exact hit
    written by another process was computed as this one computes it; "" for KV of no model.
    """

    model: str
    dtype: str
    layout_version: int = 1
    tenant_salt: str = ""
    adapter: str = ""
    numerics: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("namespace needs a model fingerprint")
        if not self.dtype:
            raise ValueError("namespace needs a dtype")
        if self.layout_version < 0:
            raise ValueError(f"layout_version must be >= 0, got {self.layout_version}")

    @cached_property
    def encoded(self) -> bytes:
        return encode_fields(
            [
                ("model", self.model),
                ("dtype", self.dtype),
                ("layout_version", self.layout_version),
                ("tenant_salt", self.tenant_salt),
                ("adapter", self.adapter),
                ("numerics", self.numerics),
            ]
        )


@dataclass(frozen=True)
class ContentKey:
    """A 32-byte digest; equal keys mean equal (namespace, content). Usable as a dict key."""

    digest: bytes
    hex: str = field(compare=False, repr=False, default="")

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_SIZE:
            raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {len(self.digest)}")
        if not self.hex:
            object.__setattr__(self, "hex", self.digest.hex())
        elif self.hex != self.digest.hex():
            raise ValueError("hex does not match digest")

    @classmethod
    def from_hex(cls, text: str) -> ContentKey:
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.hex


def _kind_prefix(kind: str) -> bytes:
    return _prefix(kind, HASH_NAME)


@lru_cache(maxsize=64)
def _prefix(kind: str, hash_name: str) -> bytes:
    return encode_value(_DOMAIN) + encode_value(hash_name) + encode_value(kind)


def _key(kind: str, parts: Sequence[bytes]) -> ContentKey:
    h = _hasher()
    h.update(_kind_prefix(kind))
    for p in parts:
        h.update(p)
    return ContentKey(h.digest()[:DIGEST_SIZE])


def digest_key(kind: str, parts: Iterable[bytes]) -> ContentKey:
    """Key of content without a typed key above: ``kind`` names what it is (two kinds never share
    a key), each of ``parts`` is framed, so ``[b"ab", b"c"]`` and ``[b"a", b"bc"]`` differ."""
    return _key(f"digest:{kind}", [_frame(b"b", p) for p in parts])


class DigestChain:
    """``digest_key(kind, parts[:i])`` for every prefix of a sequence of parts that changes at
    its end (a window that grows, or is cut back and grows again).

    The hash state after each part is kept, so a query hashes only the parts past the longest
    prefix it shares with the one before: the keys of a window of n parts cost its new parts,
    not n(n+1)/2 part hashes. ``parts_hashed`` counts the parts hashed so far.
    """

    def __init__(self, kind: str) -> None:
        h = _hasher()
        h.update(_kind_prefix(f"digest:{kind}"))
        self._parts: list[bytes] = []
        self._states = [h]  # the state after parts[:i], for i = 0..len(parts)
        self._keys = [ContentKey(h.digest()[:DIGEST_SIZE])]
        self.parts_hashed = 0

    def keys(self, parts: Sequence[bytes]) -> list[ContentKey]:
        """The key of each prefix of ``parts``, the empty one first (``len(parts) + 1`` keys)."""
        parts, known = list(parts), self._parts
        same = len(known)
        if same > len(parts) or parts[:same] != known:
            pairs = enumerate(zip(known, parts, strict=False))
            same = next((i for i, (a, b) in pairs if a != b), min(same, len(parts)))
            del known[same:], self._states[same + 1 :], self._keys[same + 1 :]
        for part in parts[same:]:
            h = self._states[-1].copy()
            h.update(_frame(b"b", part))
            known.append(part)
            self._states.append(h)
            self._keys.append(ContentKey(h.digest()[:DIGEST_SIZE]))
            self.parts_hashed += 1
        return self._keys[: len(parts) + 1]


def token_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Token ids as little-endian int64 bytes ([T] -> 8T bytes)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens, dtype="<i8")
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr.tobytes()


def token_key(namespace: Namespace, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> ContentKey:
    """Key of a text chunk: namespace and its token ids [T]."""
    return _key("tokens", [_frame(b"n", namespace.encoded), _frame(b"t", token_bytes(tokens))])


def token_keys(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray | torch.Tensor, spans: Iterable[tuple[int, int]]
) -> list[ContentKey]:
    """Keys of the chunks ``tokens[s:e]`` for each ``(s, e)`` of ``spans``; tokens [T].

    Equal to ``token_key`` on each chunk. The framed prefix (domain, hash, kind, namespace) and
    the token bytes are built once, so a chunk costs one slice and one hash call.
    """
    data, head = token_bytes(tokens), _token_head(namespace)
    return [_chunk_key(head, data[8 * s : 8 * e]) for s, e in spans]


def _token_head(namespace: Namespace) -> bytes:
    """What a token key's input holds before the token frame's length and bytes."""
    return _kind_prefix("tokens") + _frame(b"n", namespace.encoded) + b"t"


def _chunk_key(head: bytes, chunk: bytes) -> ContentKey:
    return ContentKey(_digest(head + _LENGTH.pack(len(chunk)) + chunk))


class KeyMemo:
    """Token keys of chunks seen before under one namespace: chunk token bytes -> key.

    A strong hash per chunk costs about a microsecond of Python; an agent's prompts repeat
    almost all their chunks from one request to the next, and a dictionary probe (its bytes
    hash runs in C) costs a fifth of that. Keys are a pure function of the namespace and the
    bytes, so a remembered key is the key. Holds about ``max_entries`` chunks in two
    generations: when the recent one fills, it becomes the older one and the older is dropped.
    """

    def __init__(self, namespace: Namespace, max_entries: int = 1 << 16) -> None:
        if max_entries < 2:
            raise ValueError(f"max_entries must be >= 2, got {max_entries}")
        self.namespace = namespace
        self.max_entries = max_entries
        self._head = _token_head(namespace)
        self._recent: dict[bytes, ContentKey] = {}
        self._older: dict[bytes, ContentKey] = {}

    def token_keys(
        self, tokens: Sequence[int] | np.ndarray | torch.Tensor, spans: Iterable[tuple[int, int]]
    ) -> list[ContentKey]:
        """``token_keys(self.namespace, tokens, spans)``, remembering every chunk's key."""
        data, recent, out = token_bytes(tokens), self._recent, []
        for s, e in spans:
            chunk = data[8 * s : 8 * e]
            key = recent.get(chunk)
            if key is None:
                key = self._older.get(chunk)
                if key is None:
                    key = _chunk_key(self._head, chunk)
                recent[chunk] = key
            out.append(key)
        if len(recent) > self.max_entries // 2:
            self._older, self._recent = recent, {}
        return out


def tensor_bytes(x: torch.Tensor) -> bytes:
    """Raw bytes of a tensor in C order (any dtype, bfloat16 included)."""
    flat = x.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def image_key(
    namespace: Namespace,
    pixels: torch.Tensor,
    mode: str,
    preprocess: Mapping[str, FieldValue] | None = None,
) -> ContentKey:
    """Key of an image chunk: namespace, preprocessed pixels (bytes, shape, dtype), colour mode
    (e.g. "RGB") and the preprocessing settings (sorted by name; values must be encodable)."""
    settings = sorted((preprocess or {}).items())
    meta = encode_fields([("shape", tuple(pixels.shape)), ("dtype", str(pixels.dtype)), ("mode", mode)])
    return _key(
        "image",
        [
            _frame(b"n", namespace.encoded),
            _frame(b"m", meta),
            _frame(b"p", encode_fields(settings)),
            _frame(b"x", tensor_bytes(pixels)),
        ],
    )


def span_key(namespace: Namespace, parts: Sequence[np.ndarray | str]) -> ContentKey:
    """Key of a span of a prompt in ``namespace``: its text parts as token ids ``[T]`` and its
    images as their content keys (hex strings), in order. Adjacent text parts hash as one, so the
    key does not depend on how the text was split."""
    frames, text = [], []
    for part in parts:
        if isinstance(part, str):
            if text:
                frames.append(_frame(b"t", b"".join(text)))
                text = []
            frames.append(_frame(b"i", part.encode()))
        else:
            text.append(token_bytes(part))
    if text:
        frames.append(_frame(b"t", b"".join(text)))
    return _key("span", [_frame(b"n", namespace.encoded), *frames])


def chain_key(parent: ContentKey | None, child: ContentKey) -> ContentKey:
    """Key of a prefix ending in ``child``: depends on every key before it through ``parent``."""
    return _key(
        "chain", [encode_value(None if parent is None else parent.digest), encode_value(child.digest)]
    )


def chained_keys(keys: Iterable[ContentKey]) -> list[ContentKey]:
    """Prefix keys of a chunk sequence: out[i] covers keys[0..i]."""
    out: list[ContentKey] = []
    parent: ContentKey | None = None
    for k in keys:
        parent = chain_key(parent, k)
        out.append(parent)
    return out


def fingerprint(parts: Sequence[np.ndarray | str | Sequence[int] | torch.Tensor]) -> str:
    """What a stored entry certifies about the content it holds (``Entry.tokens``): its text as
    token ids and its images as content keys, in order, with no namespace (the store key carries
    that). Adjacent text parts hash as one. 32 hex digits."""
    frames, text = [], []
    for part in parts:
        if isinstance(part, str):
            if text:
                frames.append(_frame(b"t", b"".join(text)))
                text = []
            frames.append(_frame(b"i", part.encode()))
        else:
            text.append(token_bytes(part))
    if text:
        frames.append(_frame(b"t", b"".join(text)))
    return _key("fingerprint", frames).hex[:32]

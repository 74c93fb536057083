from __future__ import annotations

import dataclasses
import hashlib
import struct
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.keys import (
    HASH_NAME,
    ContentKey,
    DigestChain,
    KeyMemo,
    Namespace,
    chain_key,
    chained_keys,
    digest_key,
    encode_value,
    image_key,
    span_key,
    token_key,
    token_keys,
)

NS = Namespace(model="smollm2-135m@abc", dtype="bfloat16")


def test_encoding_is_tagged_and_length_prefixed() -> None:
    assert encode_value("ab") == b"s" + struct.pack(">Q", 2) + b"ab"
    assert encode_value(b"ab") == b"b" + struct.pack(">Q", 2) + b"ab"
    assert encode_value(1) == b"i" + struct.pack(">Q", 1) + b"\x01"
    assert encode_value(True) != encode_value(1)
    assert encode_value(("a",)) != encode_value("a")
    with pytest.raises(TypeError, match="list"):
        encode_value([1])  # type: ignore[arg-type]


def framed_token_input(tokens: list[int], hash_name: str) -> bytes:
    def frame(tag: bytes, payload: bytes) -> bytes:
        return tag + struct.pack(">Q", len(payload)) + payload

    fields: list[tuple[str, str | int]] = [
        ("model", NS.model),
        ("dtype", NS.dtype),
        ("layout_version", 1),
        ("tenant_salt", ""),
        ("adapter", ""),
        ("numerics", ""),
    ]
    ns = b"".join(encode_value(name) + encode_value(value) for name, value in fields)
    return (
        encode_value(b"kamera.key.v1")
        + encode_value(hash_name)
        + encode_value("tokens")
        + frame(b"n", ns)
        + frame(b"t", np.array(tokens, dtype="<i8").tobytes())
    )


def test_token_key_is_blake3_of_the_framed_input() -> None:
    """Pins the byte layout: changing it silently would orphan every stored entry."""
    import blake3

    assert HASH_NAME == "blake3"
    assert token_key(NS, [5, 6, 7]).hex == blake3.blake3(framed_token_input([5, 6, 7], "blake3")).hexdigest()


def test_fallback_hash_is_blake2b(monkeypatch: pytest.MonkeyPatch) -> None:
    import cache.keys as keys

    with_blake3 = token_key(NS, [1, 2])
    monkeypatch.setattr(keys, "_blake3", None)
    monkeypatch.setattr(keys, "HASH_NAME", "blake2b-256")
    want = hashlib.blake2b(framed_token_input([1, 2], "blake2b-256"), digest_size=32).digest()
    assert token_key(NS, [1, 2]).digest == want
    assert want != with_blake3.digest


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    tokens=st.lists(st.integers(0, 2**40), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    salt=st.text(max_size=3),
)
def test_token_keys_equal_token_key_of_each_chunk(tokens: list[int], cuts: list[int], salt: str) -> None:
    ns = Namespace(NS.model, NS.dtype, tenant_salt=salt)
    b = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    spans = [*pairwise(b), (0, 0)]  # an empty chunk too
    want = [token_key(ns, tokens[s:e]) for s, e in spans]
    assert token_keys(ns, tokens, spans) == want
    assert token_keys(ns, np.array(tokens, dtype=np.int64), spans) == want


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=6),
    max_entries=st.sampled_from([2, 3, 8, 1 << 16]),
)
def test_key_memo_gives_the_same_keys_across_calls(prompts: list[list[int]], max_entries: int) -> None:
    """Few distinct token values: chunks repeat within and across calls; small bounds rotate."""
    memo = KeyMemo(NS, max_entries)
    for tokens in prompts:
        spans = [*pairwise(range(0, len(tokens) + 1, 3)), (0, len(tokens))]
        assert memo.token_keys(tokens, spans) == token_keys(NS, tokens, spans)
        assert len(memo._recent) <= max_entries // 2
    with pytest.raises(ValueError, match="max_entries"):
        KeyMemo(NS, 1)


def test_token_keys_follow_the_fallback_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    import cache.keys as keys

    monkeypatch.setattr(keys, "_blake3", None)
    monkeypatch.setattr(keys, "HASH_NAME", "blake2b-256")
    spans = [(0, 2), (2, 5)]
    assert token_keys(NS, [1, 2, 3, 4, 5], spans) == [token_key(NS, [1, 2]), token_key(NS, [3, 4, 5])]
    want = hashlib.blake2b(framed_token_input([1, 2], "blake2b-256"), digest_size=32).digest()
    assert token_keys(NS, [1, 2], [(0, 2)])[0].digest == want


def test_keys_are_small_hashable_values() -> None:
    a, b = token_key(NS, [1, 2, 3]), token_key(NS, torch.tensor([1, 2, 3]))
    assert a == b
    assert hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert len(a.digest) == 32
    assert a.hex == a.digest.hex()
    assert ContentKey.from_hex(a.hex) == a
    with pytest.raises(ValueError, match="32 bytes"):
        ContentKey(b"short")
    with pytest.raises(ValueError, match="hex"):
        ContentKey(a.digest, hex="00" * 32)


def test_domain_separation_between_tokens_and_salt() -> None:
    k1 = token_key(Namespace("m", "bf16", tenant_salt="3"), [1, 2])
    k2 = token_key(Namespace("m", "bf16", tenant_salt="23"), [1])
    k3 = token_key(Namespace("m", "bf16", tenant_salt=""), [1, 2])
    assert len({k1, k2, k3}) == 3
    # Moving characters between adjacent string fields changes the key.
    assert token_key(Namespace("ab", "c"), [1]) != token_key(Namespace("a", "bc"), [1])
    assert token_key(Namespace("m", "d", adapter="x"), [1]) != token_key(
        Namespace("m", "d", tenant_salt="x"), [1]
    )


def test_namespace_fields_each_change_the_key() -> None:
    base = token_key(NS, [9, 9])
    variants = [
        Namespace("other", NS.dtype),
        Namespace(NS.model, "float16"),
        Namespace(NS.model, NS.dtype, layout_version=2),
        Namespace(NS.model, NS.dtype, tenant_salt="t"),
        Namespace(NS.model, NS.dtype, adapter="lora-a"),
        Namespace(NS.model, NS.dtype, numerics="torch=2.5.1,threads=1"),
    ]
    keys = {token_key(ns, [9, 9]) for ns in variants}
    assert len(keys) == 6
    assert base not in keys
    with pytest.raises(ValueError, match="model"):
        Namespace("", "bf16")


def test_namespaces_differing_only_in_numerics_share_no_key() -> None:
    """The same weights, dtype, tenant and content under two thread counts: every kind of key
    differs, so KV computed under one is never found under the other."""
    one, two = (dataclasses.replace(NS, numerics=f"torch=2.5.1,threads={n},device=cpu") for n in (1, 2))
    assert token_key(one, [1, 2, 3]) != token_key(two, [1, 2, 3])
    assert span_key(one, [np.array([1, 2, 3])]) != span_key(two, [np.array([1, 2, 3])])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    salts=st.lists(st.text(max_size=4), min_size=2, max_size=2, unique=True),
    tokens=st.lists(st.integers(0, 2**31), max_size=6),
)
def test_tenant_salts_never_share_keys(salts: list[str], tokens: list[int]) -> None:
    a, b = (token_key(Namespace("m", "bf16", tenant_salt=s), tokens) for s in salts)
    assert a != b


def test_image_key_covers_pixels_shape_dtype_mode_and_settings() -> None:
    px = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    base = image_key(NS, px, "RGB", {"resize": (224, 224), "normalize": True})
    assert base == image_key(NS, px.clone(), "RGB", {"normalize": True, "resize": (224, 224)})
    variants = [
        image_key(NS, px.reshape(3, 2, 4), "RGB", {"resize": (224, 224), "normalize": True}),
        image_key(NS, px.to(torch.bfloat16), "RGB", {"resize": (224, 224), "normalize": True}),
        image_key(NS, px, "BGR", {"resize": (224, 224), "normalize": True}),
        image_key(NS, px, "RGB", {"resize": (224, 224), "normalize": False}),
        image_key(NS, px + 1, "RGB", {"resize": (224, 224), "normalize": True}),
        token_key(NS, px.reshape(-1).long()),
    ]
    assert len({base, *variants}) == 7
    # Non-contiguous views hash their logical content.
    t = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    assert image_key(NS, t.t(), "L") == image_key(NS, t.t().contiguous(), "L")


def test_chained_keys_give_prefix_semantics() -> None:
    ks = [token_key(NS, [i]) for i in range(4)]
    chain = chained_keys(ks)
    assert chain[0] == chain_key(None, ks[0])
    assert chain[3] == chain_key(chain[2], ks[3])
    # Same last chunk, different history: different chained key.
    other = chained_keys([ks[1], ks[0], ks[2], ks[3]])
    assert other[3] != chain[3]
    assert chained_keys(ks[:2]) == chain[:2]
    assert chain_key(None, ks[0]) != ks[0]


def test_digest_key_is_framed_and_kind_separated() -> None:
    """Pins the byte layout of the keys for content without a typed key (model fingerprints,
    window context keys): a silent change would orphan their stored records."""
    import blake3

    def frame(tag: bytes, payload: bytes) -> bytes:
        return tag + struct.pack(">Q", len(payload)) + payload

    want = (
        encode_value(b"kamera.key.v1")
        + encode_value("blake3")
        + encode_value("digest:model")
        + frame(b"b", b"ab")
    )
    assert digest_key("model", [b"ab"]).hex == blake3.blake3(want).hexdigest()
    assert digest_key("model", [b"ab", b"c"]) != digest_key("model", [b"a", b"bc"])
    assert digest_key("model", [b"ab"]) != digest_key("context", [b"ab"])
    assert digest_key("tokens", []) != token_key(NS, [])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(windows=st.lists(st.lists(st.binary(max_size=3), max_size=12), min_size=1, max_size=6))
def test_digest_chain_gives_digest_key_of_every_prefix(windows: list[list[bytes]]) -> None:
    chain = DigestChain("context")
    for parts in windows:  # a window grown, cut back, changed in the middle
        assert chain.keys(parts) == [digest_key("context", parts[:i]) for i in range(len(parts) + 1)]
    assert chain.keys(()) == [digest_key("context", [])]


def test_digest_chain_hashes_only_parts_past_the_shared_prefix() -> None:
    chain = DigestChain("context")
    parts = [bytes([i]) for i in range(40)]
    for n in range(1, 41):  # a window growing one part at a time: each part hashed once
        chain.keys(parts[:n])
    assert chain.parts_hashed == 40  # hashing each prefix from scratch: 40 * 41 / 2
    chain.keys(parts)
    assert chain.parts_hashed == 40
    chain.keys([*parts[:10], b"x"])  # cut back to 10, one new part
    assert chain.parts_hashed == 41

"""The byte tokenizer of the tiny random models: ids, round trip, the vocabulary the grammar reads."""

from __future__ import annotations

from agent.byte_tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok("<|im_start|>user\nhé<|im_end|>")["input_ids"]
    assert ids[0] == 2
    assert ids[-1] == 1
    assert tok.decode(ids) == "user\nhé"


def test_byte_ids_and_vocabulary_agree() -> None:
    tok = ByteTokenizer()
    assert tok.encode("A") == [ord("A") + 4]
    assert tok("x")["input_ids"] == tok.encode("x")
    vocab = tok.get_vocab()
    assert (vocab["<|im_start|>"], vocab["<|im_end|>"]) == (2, 1)
    assert sorted(vocab.values()) == [1, 2, *range(4, 260)]
    assert tok.decode([0, 3, 260, *tok.encode("ok")]) == "ok"  # ids outside the bytes are dropped

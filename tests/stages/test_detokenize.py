"""Streaming detokenization: whole characters only, stop strings that never split one and
never leak a partial match, special tokens left out unless asked."""

from __future__ import annotations

import pytest

from kvflow.stages.detokenize import IncrementalDetokenizer
from kvflow.stages.engine import Tokenizer
from kvflow.stages.engine.demo import build_tokenizer

TEXT = "Hello wörld — café 🙂 中文, the end."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tokenizer())  # byte-level: multi-byte characters span tokens


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_one_token_at_a_time_equals_decode(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # some characters take several tokens
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == TEXT == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # the first byte of a multi-byte character yields nothing


@pytest.mark.parametrize(
    ("stop", "before"),
    [("é", "Hello wörld — caf"), ("🙂 中", "Hello wörld — café "), ("end.", TEXT[:-4])],
)
def test_stop_string(tok: Tokenizer, stop: str, before: str) -> None:
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, stop=["zzz", stop])
    deltas = _stream(detok, ids + tok.encode(" more"))
    assert "".join(deltas) == before == detok.text
    assert detok.stopped == stop
    assert tok.decode(ids[: detok.num_tokens]).endswith(stop)
    included = IncrementalDetokenizer(tok, stop=[stop], include_stop=True)
    assert "".join(_stream(included, ids)) == before + stop


def test_partial_match_is_held_back_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["world"])
    sent = [detok.add(tok.encode(part)) for part in ("hello ", "wor", "d and ", "world!")]
    assert sent == ["hello ", "", "word and ", ""]
    assert detok.stopped == "world" and detok.flush() == ""
    earliest = IncrementalDetokenizer(tok, stop=["cd", "abcd", "b"])
    assert earliest.add(tok.encode("xxabcd")) == "xxa"
    assert earliest.stopped == "b"


def test_special_tokens_only_when_asked(tok: Tokenizer) -> None:
    ids = [*tok.encode("hi"), 2, *tok.encode("!")]  # 2 = </s>
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "hi!"
    shown = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(shown, ids)) == "hi</s>!"


def test_bad_stop_arguments(tok: Tokenizer) -> None:
    with pytest.raises(TypeError):
        IncrementalDetokenizer(tok, stop="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, stop=[""])


@pytest.mark.parametrize("text", ["end 🙂", "a 中", "café"])
def test_truncated_character_at_the_end_flushes_as_replacement(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)[:-1]  # the last character loses its last byte
    expected = tok.decode(ids)
    assert expected.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert "\ufffd" not in "".join(deltas)  # held mid-stream: the character might complete
    assert detok.flush() == "\ufffd"
    assert detok.text == expected
    assert detok.flush() == ""


def test_invalid_byte_mid_stream_comes_out_with_the_next_text(tok: Tokenizer) -> None:
    lone = tok.encode("中")[:1]  # a lead byte with no continuation
    ids = [*tok.encode("x"), *lone, *tok.encode("yz"), *lone]
    detok = IncrementalDetokenizer(tok)
    assert "".join(_stream(detok, ids)) == tok.decode(ids) == "x\ufffdyz\ufffd"


def test_flushed_tail_still_stops_at_a_stop_string(tok: Tokenizer) -> None:
    ids = [*tok.encode("ab"), *tok.encode("中")[:1]]
    detok = IncrementalDetokenizer(tok, stop=["b\ufffd"])
    assert detok.add(ids) == "a"  # "b" held as a possible stop start, the byte held too
    assert detok.flush() == "" and detok.stopped == "b\ufffd"
    assert detok.text == "a"

"""Corpus parsing: every format, malformed lines with their numbers, trace blocks."""

from __future__ import annotations

import json

import pytest

from kvflow.stages.warmup import Budget, CorpusFile, JobOptions, parse_corpus
from kvflow.stages.warmup.materialize import trace_block_tokens


def _file(lines: list[object], name: str = "c.jsonl") -> CorpusFile:
    body = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    return CorpusFile(name, body.encode())


def test_auto_reads_every_format_and_reports_bad_lines_by_number() -> None:
    lines: list[object] = [
        {"prompt": "a"},
        {"messages": [{"role": "user", "content": "hi"}]},
        "not json",
        {
            "custom_id": "r1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}]},
        },
        "",
        {"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [4, 5]},
        {"nothing": 1},
        {"hash_ids": [-1]},
    ]
    items, errors = parse_corpus([_file(lines), CorpusFile("doc.txt", b"plain text")])
    assert [i.kind for i in items] == ["prompt", "chat", "chat", "trace", "prompt"]
    assert [i.line for i in items] == [1, 2, 4, 6, 0]
    assert items[2].label == "r1"
    assert [(e.source, e.line) for e in errors] == [("c.jsonl", 3), ("c.jsonl", 7), ("c.jsonl", 8)]


def test_explicit_format_and_empty_and_binary_files() -> None:
    items, errors = parse_corpus([_file([{"prompt": "a"}])], "chat")
    assert not items and errors[0].line == 1
    items, errors = parse_corpus([CorpusFile("e.txt", b"  \n"), CorpusFile("b.txt", b"\xff\xfe")])
    assert not items and [e.line for e in errors] == [0, 0]
    with pytest.raises(ValueError, match="format"):
        parse_corpus([], "yaml")


def test_trace_blocks_are_deterministic_and_in_vocabulary() -> None:
    a = trace_block_tokens(7, 16, 300)
    assert a == trace_block_tokens(7, 16, 300) and a != trace_block_tokens(8, 16, 300)
    assert len(a) == 16 and all(16 <= t < 300 for t in a)


def test_options_validate_fields() -> None:
    with pytest.raises(ValueError, match="tenant"):
        JobOptions(tenant="a b")
    with pytest.raises(ValueError, match="on_limit"):
        Budget(on_limit="wait")
    with pytest.raises(ValueError, match="smaller than one block"):
        Budget(max_bytes=100).limit_blocks(4096)
    assert Budget(max_blocks=10, max_bytes=5 * 4096).limit_blocks(4096) == 5
    assert Budget().limit_blocks(4096) is None

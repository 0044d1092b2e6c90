"""A request that adopts a finished request's pages in place (``add_request(adopt_from=...)``,
what a colocated server's decode does with its prefill's KV) continues exactly as one that
imported copies of those pages, and as one engine request would, with no page copied."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.stages.engine import Engine, SamplingParams
from kvflow.stages.engine.errors import InvalidRequestError
from tests.stages.engine.conftest import open_engine

BLOCK = 8


def _prefill(engine: Engine, rid: str, prompt: list[int]) -> int:
    """The prompt's KV computed and retained, and its first greedy token (a prefill stage's
    request: max_tokens 1)."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1), retain_pages=True)
    first: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            first.extend(out.new_token_ids)
    return first[0]


def _decode(engine: Engine, rid: str) -> list[int]:
    out_ids: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                out_ids.extend(out.new_token_ids)
    return out_ids


@pytest.mark.parametrize("prompt_len", [29, 32])  # a partial last page, and a full one
def test_adopted_pages_decode_like_copied_pages(llama_dir: Path, prompt_len: int) -> None:
    prompt = [(13 * i) % 200 + 3 for i in range(prompt_len)]
    n_pages = -(-prompt_len // BLOCK)

    copy = open_engine(llama_dir)
    first = _prefill(copy, "p", prompt)
    pages = [copy.export_page("p", b).clone() for b in range(n_pages)]
    copy.release("p")
    copy.add_request(
        "d", [*prompt, first], SamplingParams(max_tokens=11), pages, prompt_len, retain_pages=True
    )
    copied = _decode(copy, "d")

    adopt = open_engine(llama_dir)
    free_before = adopt.num_free_pages
    assert _prefill(adopt, "p", prompt) == first
    prefill_page_ids = [adopt._get("p").pages[b] for b in range(n_pages)]
    adopt.add_request(
        "d",
        [*prompt, first],
        SamplingParams(max_tokens=11),
        num_prefix_tokens=prompt_len,
        retain_pages=True,
        adopt_from="p",
    )
    assert adopt._get("d").pages[:n_pages] == prefill_page_ids  # in place: the same pages
    adopted = _decode(adopt, "d")

    whole = open_engine(llama_dir).generate([prompt], SamplingParams(max_tokens=12))[0]
    assert [first, *adopted] == [first, *copied] == whole
    with pytest.raises(Exception, match="unknown request"):
        adopt.release("p")  # forgotten: its pages are the decode's now
    adopt.release("d")
    assert adopt.num_free_pages == free_before  # every page back, none twice


def test_adopt_refuses_what_it_cannot_take(llama_dir: Path) -> None:
    engine = open_engine(llama_dir)
    prompt = [(7 * i) % 150 + 3 for i in range(20)]
    first = _prefill(engine, "p", prompt)
    engine.add_request("running", [5, 6, 7], SamplingParams(max_tokens=4))
    free = engine.num_free_pages
    bad = [
        ("nobody", [*prompt, first], 20, "no finished request"),
        ("running", [*prompt, first], 2, "no finished request"),
        ("p", [9, *prompt[1:], first], 20, "does not hold"),  # other tokens
        ("p", [*prompt, first, 4], 21, "does not hold"),  # more than it computed
        ("p", [*prompt, first], 21, "at least one token"),
    ]
    for source, tokens, n_prefix, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(
                "d",
                tokens,
                SamplingParams(max_tokens=4),
                num_prefix_tokens=n_prefix,
                adopt_from=source,
            )
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        engine.add_request(
            "d",
            [*prompt, first],
            SamplingParams(max_tokens=4),
            [engine.export_page("p", 0)],
            num_prefix_tokens=8,
            adopt_from="p",
        )
    # add_request's checks of the request itself hold for an adopting one (one place)
    for kw, message in [
        ({"block_keys": ["k"] * 4}, "block keys"),
        ({"sampling": SamplingParams(max_tokens=4, logit_bias=((10**6, 1.0),))}, "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(
                "d", [*prompt, first], **{"sampling": SamplingParams(max_tokens=4), **kw},
                num_prefix_tokens=20, adopt_from="p",
            )  # fmt: skip
    assert engine.num_free_pages == free  # nothing changed
    engine.release("p")  # still the prefill's

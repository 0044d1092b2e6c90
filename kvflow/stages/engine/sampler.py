"""Token sampling: penalties, then greedy or temperature with top-k / top-p, seeded per
request; and the log probabilities that outputs and prompts report."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.stages.engine.config import SamplingParams
from kvflow.stages.engine.grammar import Constraint
from kvflow.stages.engine.sequence import Sequence as Seq
from kvflow.stages.engine.sequence import TokenLogprob


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], int]] | None = None,
    constraints: Sequence[Constraint | None] | None = None,
) -> list[int]:
    """One token per row of float32 logits [N, vocab]. `histories[row]` is (token ids so far,
    prompt length), needed only for rows whose params set a penalty. `constraints[row]`, where
    given, masks the row to the tokens its grammar allows (after logit_bias and penalties);
    the constraint is not advanced here. Greedy rows take the
    argmax of the penalized logits (ties to the lowest id); others sample with their own
    generator, which advances; a row whose distribution is not finite falls back to its argmax,
    so one request can never fail the rows sampled beside it. Does not modify `logits`."""
    tokens: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        row_logits = torch.nan_to_num(logits[row].to(torch.float32), nan=float("-inf"))
        if p.penalized:
            if histories is None:
                raise ValueError("penalties need the token history of each row")
            ids, prompt_len = histories[row]
            row_logits = apply_penalties(row_logits, ids, prompt_len, p)
        if p.logit_bias:
            row_logits = apply_logit_bias(row_logits, p.logit_bias)
        constraint = constraints[row] if constraints is not None else None
        if constraint is not None:
            row_logits = constraint.mask(row_logits)
        best = int(row_logits.argmax())
        tokens.append(best if p.greedy else _sample_row(row_logits, p, gen, fallback=best))
    return tokens


def plain_greedy(params: SamplingParams, constraint: Constraint | None) -> bool:
    """Whether `sample` takes a row of these params as the plain argmax of its logits: greedy,
    no penalty, no logit bias, no grammar."""
    return params.greedy and not params.penalized and not params.logit_bias and constraint is None


def plain_sampled(params: SamplingParams, constraint: Constraint | None) -> bool:
    """Whether `sample` takes a row of these params as a draw from softmax(logits /
    temperature) over every token: a temperature only (no top-k, top-p, penalty, logit bias
    or grammar)."""
    return (
        not params.greedy
        and params.top_k == 0
        and params.top_p >= 1.0
        and not params.penalized
        and not params.logit_bias
        and constraint is None
    )


def sample_rows(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """`sample`'s token for every row of float32 logits [N, vocab] as if each were
    `plain_sampled` with its temperature and generator: the same draws, from the same
    generators, as row by row, but each step of it one operation over the rows (a decode
    batch of 64 sampled rows: one softmax, not 64)."""
    x = torch.nan_to_num(logits.to(torch.float32), nan=float("-inf"))
    best = x.argmax(-1)
    temps = torch.tensor(list(temperatures), dtype=torch.float32, device=x.device)
    probs = (x / temps[:, None]).softmax(-1)
    finite = (torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0.0)).tolist()
    cdf = probs.cumsum(-1, dtype=torch.float64)
    u = torch.zeros(len(finite), dtype=torch.float64, device=x.device)
    for row, (ok, gen) in enumerate(zip(finite, generators, strict=True)):
        if ok:  # as `_sample_row`: a row that falls back to its argmax draws nothing
            u[row] = torch.rand((), generator=gen, dtype=torch.float64, device=x.device)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    ok_rows = torch.tensor(finite, dtype=torch.bool, device=x.device)
    return torch.where(ok_rows, drawn, best).tolist()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """`sample`'s token for every row of float32 logits [N, vocab] as if each were
    `plain_greedy`, in one reduction and one read back to the host (a GPU batch then waits
    for the device once a step, not once a row). NaN counts as -inf, as in `sample`."""
    return torch.nan_to_num(logits.to(torch.float32), nan=float("-inf")).argmax(-1).tolist()


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """A copy of one float32 row [vocab] with each (token id, bias) added (ids past the row
    are ignored: the engine refuses them before a request runs)."""
    vocab = logits.shape[-1]
    pairs = [(t, b) for t, b in bias if t < vocab]
    if not pairs:
        return logits
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=logits.device)
    vals = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, ids, vals)


def apply_penalties(
    logits: torch.Tensor, token_ids: Sequence[int], prompt_len: int, p: SamplingParams
) -> torch.Tensor:
    """A penalized float32 copy of one row [vocab] (see SamplingParams for the rules):
    repetition over prompt and output, then frequency and presence over the output."""
    out = logits.to(torch.float32).clone()
    vocab = out.shape[-1]
    if p.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.int64, device=out.device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    generated = token_ids[prompt_len:]
    if generated and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
        ids = torch.tensor(list(generated), dtype=torch.int64, device=out.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(torch.float32)
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, fallback: int
) -> int:
    """One sampled token; ``fallback`` (the argmax) when the distribution is not finite, so
    one row can never fail the rows sampled beside it."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cum - sorted_logits.softmax(-1)) >= p.top_p  # keeps at least the top token
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        return fallback
    return draw(probs, gen)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """A token from one row of probabilities [vocab] (finite, summing to more than 0), by
    the inverse of its distribution function: one uniform number u from ``gen``, and the
    first token whose running sum (in float64) exceeds u times the total. A token of
    probability 0 is never drawn.

    One random number a row: torch.multinomial draws one sample as the argmax of
    probs / Exp(1) over the whole vocabulary, an exponential number (a log each, on one
    thread) for each of the 49,152 tokens of the default model: ~2.5 ms a row here, 160 ms of
    a 64-row decode step (docs/performance.md, "Sampling")."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    u = torch.rand((), generator=gen, dtype=torch.float64, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1), right=True)[0])


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """For each row of raw logits [N, vocab] and the token chosen at that row: its log
    probability under softmax(logits), its rank (1 = most likely; ties share the better
    rank) and the `top` most likely (id, logprob), best first."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = torch.tensor(list(token_ids), dtype=torch.int64, device=logp.device)
    chosen_lp = logp.gather(1, chosen[:, None])[:, 0]
    ranks = (logp > chosen_lp[:, None]).sum(dim=-1) + 1
    top_vals = top_ids = None
    if top > 0:
        top_vals, top_ids = torch.topk(logp, top, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for i, (tok, lp, rank) in enumerate(
        zip(token_ids, chosen_lp.tolist(), ranks.tolist(), strict=True)
    ):
        alts = () if top_ids is None else tuple(zip(top_ids[i], top_vals[i], strict=True))
        out.append(TokenLogprob(int(tok), float(lp), int(rank), alts))
    return out


def prompt_logprobs(seq: Seq, start: int, logits: torch.Tensor | None) -> tuple[TokenLogprob, ...]:
    """The prompt tokens a prefill chunk scored: row i of the chunk's logits (the chunk
    began at position `start`; `seq.num_computed` is already past it) scores token
    start + i + 1; rows past the prompt are not prompt logprobs."""
    top = seq.sampling.prompt_logprobs
    assert logits is not None and top is not None
    targets = seq.token_ids[start + 1 : min(seq.num_computed + 1, seq.prompt_len)]
    if not targets:
        return ()
    return tuple(token_logprobs(logits[: len(targets)], targets, top))

"""Engine: the façade over loader, page pool, scheduler, runner and sampler.

Typical use::

    engine = Engine.open("path/to/model", EngineConfig(dtype="bfloat16"))
    engine.add_request("r1", engine.tokenizer.encode("hello"), SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():
            ...

NOT thread-safe: one thread owns the engine and calls every method (add_request, step,
export_page, ...). Validation errors raise from the call that was given bad input and leave
the engine and its other requests untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from kvflow.stages.engine.allocator import tune_malloc
from kvflow.stages.engine.config import EngineConfig, SamplingParams, require_device
from kvflow.stages.engine.decode_graphs import DecodeGraphs, graph_pages, graphs_apply
from kvflow.stages.engine.errors import (
    InvalidRequestError,
    ModelLoadError,
    PageLayoutError,
    UnknownRequestError,
)
from kvflow.stages.engine.gguf_import import gguf_hint
from kvflow.stages.engine.grammar import Constraint, GrammarCompiler
from kvflow.stages.engine.loader import fingerprint, load_weights
from kvflow.stages.engine.model import CausalLM
from kvflow.stages.engine.model_card import ModelCard
from kvflow.stages.engine.pages import KVLayout, PageData, PagePool, resident_pages
from kvflow.stages.engine.runner import ModelRunner
from kvflow.stages.engine.sampler import (
    argmax_rows,
    plain_greedy,
    plain_sampled,
    prompt_logprobs,
    sample,
    sample_rows,
    token_logprobs,
)
from kvflow.stages.engine.scheduler import StepPlan, plan_step
from kvflow.stages.engine.sequence import FinishReason, RequestOutput, Sequence, TokenLogprob
from kvflow.stages.engine.spec import ModelSpec, load_spec
from kvflow.stages.engine.step_budget import StepBudget
from kvflow.stages.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Engine:
    """A Llama-architecture model with a paged KV pool, chunked prefill and continuous
    batching. Build with `Engine.open`. Not thread-safe (see module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        model_fingerprint: str,
        card: ModelCard | None = None,
    ) -> None:
        spec = model.spec
        self.config = config
        self.spec: ModelSpec = spec
        self.tokenizer = tokenizer
        self.model_fingerprint = model_fingerprint
        self.card = card or ModelCard(name="model", eos_token_ids=spec.eos_token_ids)
        self.max_model_len = config.max_model_len or spec.max_position_embeddings
        self.device = torch.device(config.device)
        if self.device.type == "cpu":  # freed activations stay mapped (allocator.py)
            tune_malloc()
        self.kv_layout = KVLayout(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            config.block_size,
            config.precision.compute,
        )
        graphs = graphs_apply(config.decode_graphs, self.device)
        self._pool = PagePool(
            config.num_pages,
            self.kv_layout,
            config.torch_dtype,
            self.device,
            resident=self._resident(config),
            spare=1 if graphs else 0,  # the decode graphs' padding rows write there
        )
        decode_graphs = None
        if graphs:
            max_pages = graph_pages(self.max_model_len, config.block_size)
            capture = self.device.type == "cuda"
            decode_graphs = DecodeGraphs(model, self._pool, config.max_batch, max_pages, capture)
        self._runner = ModelRunner(model, self._pool, self.device, decode_graphs)
        self.model = model
        self._seqs: dict[str, Sequence] = {}  # live and retained-finished, in arrival order
        # Pages that hold a keyed full prompt block (``add_request(block_keys=...)``): a
        # request with the same key holds the same page instead of a copy of its own.
        self._by_key: dict[Hashable, int] = {}
        self._page_key: dict[int, Hashable] = {}
        self._pending: list[RequestOutput] = []  # aborts reported by the next step
        self._arrivals = 0
        self._steps = 0
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # config.tbt_target_ms: the mixed step's prompt budget from measured step times
        self.step_budget = (
            None
            if config.tbt_target_ms is None
            else StepBudget(
                config.tbt_target_ms / 1000.0, config.mixed_chunk or config.prefill_chunk
            )
        )
        self.clock = time.perf_counter  # what steps are timed with (for step_budget)
        self.last_plan: StepPlan | None = None  # the latest step's plan (for step traces)

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler (built on first use; thread-safe, so a front may
        compile a request's grammar before queueing it, and the engine's compile hits its
        cache)."""
        with self._grammars_lock:
            if self._grammars is None:
                stops = set(self.spec.eos_token_ids) | set(self.card.eos_token_ids)
                self._grammars = GrammarCompiler.for_tokenizer(
                    self.tokenizer.inner, self.spec.vocab_size, stops
                )
            return self._grammars

    def use_grammars(self, compiler: GrammarCompiler) -> None:
        """Share another engine's (or a front's) compiler of the same tokenizer and cache."""
        with self._grammars_lock:
            self._grammars = compiler

    @classmethod
    def open(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load config.json, the safetensors weights and tokenizer.json from `model_dir`, and
        its ModelCard (generation_config.json, chat template): the EOS ids of both configs stop
        generation.

        Raises ModelLoadError naming a missing file, an unsupported architecture or a weight
        mismatch; ValueError for a max_model_len above the model's, or a device this process
        cannot run on (`require_device`)."""
        config = config or EngineConfig()
        device = require_device(config.device)
        path = Path(model_dir)
        if path.suffix.lower() == ".gguf" and path.is_file():
            raise gguf_hint(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {path} does not exist")
        spec, config_bytes = load_spec(path)
        card = ModelCard.from_dir(path)
        spec = dataclasses.replace(spec, eos_token_ids=card.eos_token_ids)
        tokenizer = Tokenizer.from_dir(path)
        if config.max_model_len and config.max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {spec.max_position_embeddings}"
            )
        model = load_weights(path, spec, config.torch_dtype, device, quant=config.precision)
        fp = fingerprint(path, config_bytes, config.dtype)
        return cls(model, tokenizer, config, fp, card)

    # ----------------------------------------------------------------- properties
    @property
    def eos_token_id(self) -> int | None:
        """The model's (first) EOS token id, or None if the config names none."""
        return self.spec.eos_token_ids[0] if self.spec.eos_token_ids else None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """(layers, 2, kv_heads, block_size, head_dim)."""
        return self.kv_layout.page_shape

    @property
    def page_dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    @property
    def page_nbytes(self) -> int:
        return self._pool.page_nbytes

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def _resident(self, config: EngineConfig) -> int:
        """The pool's pages written at open: ``config.prefault_pages`` (at most the pool), and
        never fewer than one sequence's."""
        one = self.resident_pages(config.num_pages)
        if config.prefault_pages is None:
            return one
        return max(one, min(config.num_pages, config.prefault_pages))

    def resident_pages(self, num_pages: int) -> int:
        """How many of ``num_pages`` lazily mapped pages (the pool's, or a staging area's
        slots for this engine) to map at start-up: one sequence's (`pages.resident_pages`)."""
        return resident_pages(num_pages, self.config.block_size, self.max_model_len)

    @property
    def decode_graph_buckets(self) -> list[tuple[int, int]]:
        """The (batch, pages) buckets whose fixed-shape decode forward was built so far (and
        on a CUDA device captured as a graph; decode_graphs.py); [] without them."""
        graphs = self._runner.graphs
        return [] if graphs is None else graphs.buckets

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    @property
    def pool_tensor(self) -> torch.Tensor:
        """The whole page pool, ``[num_pages (+ 1 spare page with decode graphs), *page_shape]``,
        contiguous. Page ``p`` starts at byte ``p * page_nbytes``; transfer engines register it
        as one segment. Read-only use: only the engine writes it."""
        return self._pool.tensor

    @property
    def host_pool(self) -> torch.Tensor:
        """The host-memory tensor (``pool_tensor``'s shape) whose views `export_pages`
        returns: the pool itself on the CPU; on a GPU its mirror in host memory. Transfer
        engines register this one as the instance's segment (page ``p`` at byte
        ``p * page_nbytes``). Read-only use."""
        return self._pool.host

    def has_unfinished(self) -> bool:
        """True while some request still has work (or an abort is not yet reported)."""
        return bool(self._pending) or any(s.finish_reason is None for s in self._seqs.values())

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def token_ids(self, request_id: str) -> list[int]:
        """A copy of the request's tokens (prompt + generated)."""
        return list(self._get(request_id).token_ids)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        prefix_pages: Seq[PageData] = (),
        num_prefix_tokens: int = 0,
        retain_pages: bool = False,
        verify_pages: bool = True,
        num_output_tokens: int = 0,
        block_keys: Seq[Hashable] = (),
        adopt_from: str | None = None,
    ) -> None:
        """Queue a request. Its first `num_prefix_tokens` tokens already have their KV in
        `prefix_pages` (page i holds tokens [i*B, (i+1)*B); the last page may be partial);
        at least one token must remain to compute. Pages for the whole request (prompt plus
        max_tokens) are reserved now. Imported pages are copied once, straight into the pool; the
        caller keeps its buffers. ``verify_pages=False`` skips the scan for non-finite values
        (for pages whose integrity is already checked, e.g. checksummed by kvdb).
        ``num_output_tokens``: the last that many of `token_ids` were already generated (a
        disaggregated decode continues after the prefill instance's first token): a grammar
        (``sampling.grammar``) starts after them.
        ``adopt_from``: instead of `prefix_pages`, the first `num_prefix_tokens` tokens' KV is
        in the pages of that finished, retained request of this engine (the same tokens): they
        become this request's pages in place, with no copy, and the other request is
        forgotten (its pages past the prefix are freed). A colocated server's decode takes
        over its prefill's KV this way.

        ``block_keys``: keys of the first full blocks of `token_ids` (key i names the tokens
        [0, (i+1)*B) and the KV they give, e.g. a chained block hash); at most
        ``len(token_ids) // block_size``. Requests that give the same key share the pool page
        of that block while one of them holds it: an imported block whose key a live page
        holds is not copied (the request holds that page), and a computed or imported one is
        offered to later requests. Shared pages are never written (a request writes only
        past its prefix), and a decode batch whose requests start with the same pages attends
        to them once (attention.py).

        Raises InvalidRequestError (duplicate id, empty or out-of-vocabulary tokens, prompt
        longer than max_model_len, bad num_prefix_tokens), PageLayoutError (wrong page count,
        size, shape, dtype or non-finite values), OutOfPagesError (pool too full). On any
        error nothing changes."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(sampling)}")
        tokens = self._check_tokens(request_id, token_ids)
        # adopted pages are the source's: their count is not the caller's to give
        n_prefix = self._check_prefix(
            tokens, None if adopt_from is not None else prefix_pages, num_prefix_tokens
        )
        adopted = self._check_adopt(adopt_from, tokens, n_prefix, prefix_pages)
        pages = self._pool.check_pages(prefix_pages, verify_pages)
        generator = self._generator(request_id, sampling)  # may raise: before any page is taken
        constraint = self._constraint(request_id, sampling, tokens, num_output_tokens)
        keys = self._check_keys(request_id, tokens, block_keys)
        if adopted is not None:
            self._add_adopting(
                request_id, tokens, sampling, adopted, n_prefix, retain_pages,
                generator, constraint, keys,
            )  # fmt: skip
            return
        bs = self.config.block_size
        # Full imported blocks a live page already holds: shared, not copied.
        held = [self._by_key.get(k) for k in keys[: n_prefix // bs]]
        n_new = self._pages_for(tokens, sampling) - sum(p is not None for p in held)
        new_ids = iter(self._pool.allocate(n_new))
        page_ids = [p if p is not None else next(new_ids) for p in held]
        page_ids.extend(new_ids)
        for i, (pid, page) in enumerate(zip(page_ids, pages, strict=False)):
            if i < len(held) and held[i] is not None:
                self._pool.share(pid)
            else:
                self._pool.write_pages([pid], [page])
                if i < len(held):
                    self._offer(keys[i], pid)
        self._queue(
            request_id,
            tokens,
            sampling,
            page_ids,
            n_prefix,
            retain_pages,
            generator,
            constraint,
            keys,
        )
        logger.debug("req=%s added: %d tokens, %d imported", request_id, len(tokens), n_prefix)

    def _pages_for(self, tokens: list[int], sampling: SamplingParams) -> int:
        """Pages for the whole request: KV is computed for the prompt and every generated
        token but the last."""
        longest = max(len(tokens), self.max_model_len - 1)
        kv_tokens = min(len(tokens) + sampling.max_tokens - 1, longest)
        return -(-kv_tokens // self.config.block_size)

    def _queue(
        self,
        request_id: str,
        tokens: list[int],
        sampling: SamplingParams,
        page_ids: list[int],
        n_prefix: int,
        retain_pages: bool,
        generator: torch.Generator | None,
        constraint: Constraint | None,
        keys: tuple[Hashable, ...],
    ) -> None:
        self._seqs[request_id] = Sequence(
            request_id=request_id,
            token_ids=tokens,
            prompt_len=len(tokens),
            sampling=sampling,
            pages=page_ids,
            num_computed=n_prefix,
            stop_ids=self._stop_ids(sampling),
            max_len=self.max_model_len,
            retain_pages=retain_pages,
            arrival=self._arrivals,
            generator=generator,
            constraint=constraint,
            block_keys=keys,
        )
        self._arrivals += 1

    def _check_adopt(
        self, source_id: str | None, tokens: list[int], n_prefix: int, prefix_pages: Seq[PageData]
    ) -> Sequence | None:
        """The finished retained request whose pages ``tokens``' first ``n_prefix`` tokens
        (checked) take over (None: no adoption)."""
        if source_id is None:
            return None
        if prefix_pages:
            raise InvalidRequestError("adopt_from and prefix_pages exclude each other")
        source = self._seqs.get(source_id)
        if source is None or source.finish_reason is None or not source.retain_pages:
            raise InvalidRequestError(
                f"adopt_from {source_id!r}: no finished request with retained pages by that id"
            )
        if source.num_computed < n_prefix or source.token_ids[:n_prefix] != tokens[:n_prefix]:
            raise InvalidRequestError(
                f"adopt_from {source_id!r}: its KV does not hold these {n_prefix} prefix tokens"
            )
        return source

    def _add_adopting(
        self,
        request_id: str,
        tokens: list[int],
        sampling: SamplingParams,
        source: Sequence,
        n_prefix: int,
        retain_pages: bool,
        generator: torch.Generator | None,
        constraint: Constraint | None,
        keys: tuple[Hashable, ...],
    ) -> None:
        """``add_request(adopt_from=...)`` once every check passed: the source's first pages
        become this request's."""
        keep = -(-n_prefix // self.config.block_size)
        extra = self._pool.allocate(max(0, self._pages_for(tokens, sampling) - keep))
        # nothing can fail past here: the source's pages change owner
        self._free_pages(source.pages[keep:])
        del self._seqs[source.request_id]
        pages = [*source.pages[:keep], *extra]
        # the kept pages stay offered under the keys the source gave them (the same tokens)
        self._queue(
            request_id,
            tokens,
            sampling,
            pages,
            n_prefix,
            retain_pages,
            generator,
            constraint,
            keys,
        )
        logger.debug(
            "req=%s added: %d tokens, %d adopted from %s",
            request_id,
            len(tokens),
            n_prefix,
            source.request_id,
        )

    def _check_tokens(self, request_id: str, token_ids: Seq[int]) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._seqs:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        tokens = list(token_ids)
        if not tokens:
            raise InvalidRequestError(f"request {request_id!r}: token_ids is empty")
        vocab = self.spec.vocab_size
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"request {request_id!r}: token_ids[{i}] = {t!r} is outside the "
                    f"vocabulary [0, {vocab})"
                )
        if len(tokens) > self.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt of {len(tokens)} tokens exceeds "
                f"max_model_len {self.max_model_len}"
            )
        return tokens

    def _check_prefix(self, tokens: list[int], pages: Seq[PageData] | None, n_prefix: int) -> int:
        """``pages``: the imported pages, whose count is checked (None: adopted pages)."""
        if isinstance(n_prefix, bool) or not isinstance(n_prefix, int):
            raise InvalidRequestError(f"num_prefix_tokens must be an int, got {n_prefix!r}")
        if not 0 <= n_prefix < len(tokens):
            raise InvalidRequestError(
                f"num_prefix_tokens {n_prefix} must be in [0, {len(tokens)}): at least one "
                "token must remain to compute"
            )
        needed = -(-n_prefix // self.config.block_size)
        if pages is not None and len(pages) != needed:
            raise PageLayoutError(
                f"{n_prefix} prefix tokens need {needed} pages of {self.config.block_size} "
                f"tokens, got {len(pages)}"
            )
        return n_prefix

    def _check_keys(
        self, request_id: str, tokens: list[int], keys: Seq[Hashable]
    ) -> tuple[Hashable, ...]:
        keys = tuple(keys)
        full = len(tokens) // self.config.block_size
        if len(keys) > full:
            raise InvalidRequestError(
                f"request {request_id!r}: {len(keys)} block keys, but its {len(tokens)} tokens "
                f"fill only {full} blocks of {self.config.block_size}"
            )
        for i, k in enumerate(keys):
            if not isinstance(k, Hashable):
                raise InvalidRequestError(f"request {request_id!r}: block key {i} is unhashable")
        return keys

    def _offer(self, key: Hashable, page_id: int) -> None:
        """Let later requests with ``key`` share ``page_id`` (unless a page holds it already)."""
        if key not in self._by_key:
            self._by_key[key] = page_id
            self._page_key[page_id] = key

    def _free_pages(self, pages: list[int]) -> None:
        for pid in self._pool.free(pages):
            key = self._page_key.pop(pid, None)
            if key is not None:
                del self._by_key[key]

    @property
    def num_shared_pages(self) -> int:
        """Pages that more than one request holds (prompt blocks shared by key)."""
        return sum(1 for pid in self._page_key if self._pool.holders(pid) > 1)

    def _constraint(
        self, request_id: str, sampling: SamplingParams, tokens: list[int], num_output: int
    ) -> Constraint | None:
        vocab = self.spec.vocab_size
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"request {request_id!r}: logit_bias token {bad[0]} is outside the vocabulary "
                f"(size {vocab})"
            )
        if sampling.grammar is None:
            return None
        if not 0 <= num_output < len(tokens):
            raise InvalidRequestError(f"num_output_tokens must be in [0, {len(tokens)})")
        constraint = self.grammars.constraint(sampling.grammar)
        for token in tokens[len(tokens) - num_output :]:
            if not constraint.accept(token):
                raise InvalidRequestError(
                    f"request {request_id!r}: generated token {token} does not match its grammar"
                )
        return constraint

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops.update(self.spec.eos_token_ids)
        return frozenset(stops)

    def _generator(self, request_id: str, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.greedy:
            return None
        seed = sampling.seed
        if seed is None:  # stable across processes: never Python's hash()
            digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
            seed = (self.config.seed ^ int.from_bytes(digest, "little")) & (2**63 - 1)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def _get(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a running request now; the next step() reports it with finish_reason "abort".
        Its pages are freed unless it was added with retain_pages. Aborting a finished request
        does nothing. Raises UnknownRequestError for an unknown id."""
        seq = self._get(request_id)
        if seq.finish_reason is not None:
            return
        seq.finish_reason = FinishReason.ABORT
        self._pending.append(self._output(seq, [], (), None))
        self._finish(seq)

    def release(self, request_id: str) -> None:
        """Free the pages of a finished request added with retain_pages=True and forget it.
        Raises UnknownRequestError for an unknown id, InvalidRequestError if still running."""
        seq = self._get(request_id)
        if seq.finish_reason is None:
            raise InvalidRequestError(f"request {request_id!r} is still running; abort it first")
        self._free_pages(seq.pages)
        del self._seqs[request_id]

    def _finish(self, seq: Sequence) -> None:
        if not seq.retain_pages:
            self._free_pages(seq.pages)
            del self._seqs[seq.request_id]

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: prefill chunks (at most prefill_chunk prompt tokens in
        all; when requests decode, mixed_chunk, or with tbt_target_ms the step budget's
        tokens; without a target, prefill_chunk again while more than one prompt waits) and
        one decode step for up to max_batch running requests, run as one forward pass
        (config.mixed_forward) or one per chunk plus one for the decode batch (always when a
        chunk asks for prompt logprobs).
        Returns one output per request that made progress or finished (including aborts
        since the last step)."""
        outputs, self._pending = self._pending, []
        cfg = self.config
        budget = self.step_budget
        started = self.clock()
        mixed = cfg.mixed_chunk if budget is None else budget.tokens()
        # a queue of prompts beside streams: the whole chunk (not with a step-time target)
        queued = cfg.prefill_chunk if budget is None else None
        plan = plan_step(
            list(self._seqs.values()), cfg.prefill_chunk, cfg.max_batch, mixed, queued,
            timed=budget is not None,
        )  # fmt: skip
        self._steps += 1
        self.last_plan = plan
        self._run(plan, outputs)
        if budget is not None:
            prompt_tokens = sum(n for _, n in plan.prefill)
            budget.observe(prompt_tokens, len(plan.decode), self.clock() - started)
        return outputs

    def _run(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """Execute a step's plan, appending its requests' outputs."""
        if self._one_forward(plan.prefill, plan.decode):
            chunk_logits, decode_logits = self._runner.mixed(plan.prefill, plan.decode)
            for (seq, n), logits in zip(plan.prefill, chunk_logits, strict=True):
                start = seq.num_computed
                seq.num_computed += n
                outputs.append(self._advance(seq, start, None if logits is None else logits[None]))
        else:
            for seq, n in plan.prefill:
                outputs.append(self._prefill(seq, n))
            decode_logits = self._runner.decode(plan.decode) if plan.decode else None
        if decode_logits is not None:
            plain = [plain_greedy(seq.sampling, seq.constraint) for seq in plan.decode]
            argmax = argmax_rows(decode_logits) if sum(plain) > 1 else None
            drawn = self._sample_rows(plan.decode, decode_logits)
            for row, seq in enumerate(plan.decode):
                start = seq.num_computed
                seq.num_computed += 1
                seq.last_decode_step = self._steps
                token = argmax[row] if argmax is not None and plain[row] else drawn.get(row)
                outputs.append(self._advance(seq, start, decode_logits[row : row + 1], token=token))

    @staticmethod
    def _sample_rows(decode: Seq[Sequence], logits: torch.Tensor) -> dict[int, int]:
        """The tokens of a decode batch's `plain_sampled` rows (row -> token) where there
        are several, drawn together (`sample_rows`); the other rows sample one by one."""
        rows = [r for r, seq in enumerate(decode) if plain_sampled(seq.sampling, seq.constraint)]
        if len(rows) < 2:
            return {}
        temps = [decode[r].sampling.temperature for r in rows]
        tokens = sample_rows(logits[rows], temps, [decode[r].generator for r in rows])
        return dict(zip(rows, tokens, strict=True))

    def _one_forward(self, chunks: Seq[tuple[Sequence, int]], decode: Seq[Sequence]) -> bool:
        """Whether a step's work runs as one forward pass: more than one part (chunks, the
        decode batch), mixing enabled, and no chunk asking for every position's logits."""
        parts = len(chunks) + (1 if decode else 0)
        return (
            self.config.mixed_forward
            and parts > 1
            and all(seq.sampling.prompt_logprobs is None for seq, _ in chunks)
        )

    def _prefill(self, seq: Sequence, n: int) -> RequestOutput:
        """One prefill chunk as a forward of its own (with prompt logprobs if asked)."""
        start = seq.num_computed
        want_prompt = seq.sampling.prompt_logprobs is not None
        logits = self._runner.prefill(seq, n, all_logits=want_prompt)
        seq.num_computed += n
        prompt_lps = prompt_logprobs(seq, start, logits) if want_prompt else ()
        if logits is not None and want_prompt:
            logits = logits[-1] if seq.num_computed == len(seq.token_ids) else None
        last = None if logits is None else logits[None]
        return self._advance(seq, start, last, prompt_lps)

    def _advance(
        self,
        seq: Sequence,
        start: int,
        logits: torch.Tensor | None,
        prompt_lps: tuple[TokenLogprob, ...] = (),
        token: int | None = None,
    ) -> RequestOutput:
        """``token``: the row's token when already chosen (`argmax_rows` for a plain greedy
        row of a decode batch: what `sample` would choose)."""
        bs = self.config.block_size
        completed = tuple(range(start // bs, seq.num_computed // bs))
        for b in completed:
            if b < len(seq.block_keys):
                self._offer(seq.block_keys[b], seq.pages[b])
        new: list[int] = []
        lps: tuple[TokenLogprob, ...] = ()
        if logits is not None:
            history = [(seq.token_ids, seq.prompt_len)]
            new = (
                [token]
                if token is not None
                else sample(logits, [seq.sampling], [seq.generator], history, [seq.constraint])
            )
            if seq.sampling.logprobs is not None:
                lps = tuple(token_logprobs(logits, new, seq.sampling.logprobs))
            if seq.append_token(new[0]) is not None:
                self._finish(seq)
        keep = logits.clone() if logits is not None and self.config.return_logits else None
        out = self._output(seq, new, completed, keep)
        if lps or prompt_lps:
            out = dataclasses.replace(
                out,
                logprobs=lps,
                prompt_logprobs=prompt_lps,
                prompt_logprobs_start=start + 1 if prompt_lps else 0,
            )
        return out

    @staticmethod
    def _output(
        seq: Sequence, new: list[int], completed: tuple[int, ...], logits: torch.Tensor | None
    ) -> RequestOutput:
        reason = seq.finish_reason
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tuple(new),
            finished=reason is not None,
            finish_reason=None if reason is None else str(reason),
            num_computed_tokens=seq.num_computed,
            completed_blocks=completed,
            logits=keep_cpu(logits),
        )

    # ----------------------------------------------------------------- pages
    def _page_id(self, request_id: str, block_index: int) -> int:
        seq = self._get(request_id)
        written = -(-seq.num_computed // self.config.block_size)
        if isinstance(block_index, bool) or not isinstance(block_index, int):
            raise InvalidRequestError(f"block_index must be an int, got {block_index!r}")
        if not 0 <= block_index < written:
            raise InvalidRequestError(
                f"request {request_id!r} has {written} pages with computed KV; "
                f"block_index {block_index} is out of range"
            )
        return seq.pages[block_index]

    def export_page(self, request_id: str, block_index: int) -> torch.Tensor:
        """The page holding tokens [i*B, (i+1)*B) of the request: a VIEW into the pool
        (contiguous, page_shape, page_dtype), valid until the request's pages are freed.
        Slots past num_computed_tokens hold stale data. Copy it to keep it longer."""
        return self._pool.page(self._page_id(request_id, block_index))

    def export_pages(self, request_id: str, blocks: Seq[int]) -> dict[int, torch.Tensor]:
        """The request's pages ``blocks`` (block index -> page) in host memory: views into
        ``host_pool``, valid until the request's pages are freed. On the CPU the pool's own
        pages (no copy, as `export_page`); on a GPU copied to the host mirror first, all in
        one device-to-host copy. What the serving stages store and stream."""
        blocks = list(blocks)
        views = self._pool.export([self._page_id(request_id, b) for b in blocks])
        return dict(zip(blocks, views, strict=True))

    def export_page_bytes(self, request_id: str, block_index: int) -> bytes:
        """A copy of the page's raw bytes (page_nbytes long), importable by add_request."""
        return self._pool.page_bytes(self._page_id(request_id, block_index))

    # ----------------------------------------------------------------- convenience
    def generate(
        self, prompts: Seq[Seq[int]], sampling: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run prompts to completion (alongside any requests already queued) and return each
        prompt's generated tokens. Request ids are "generate-<n>"."""
        base = self._arrivals
        ids = [f"generate-{base + i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, sampling)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        return [result[rid] for rid in ids]


def keep_cpu(logits: torch.Tensor | None) -> torch.Tensor | None:
    return None if logits is None else logits.detach().to("cpu")

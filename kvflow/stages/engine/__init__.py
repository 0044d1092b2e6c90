"""The torch model engine: a Llama-architecture decoder with paged KV, chunked prefill and
continuous batching. See README.md in this folder for the layers and the API."""

from __future__ import annotations

from kvflow.stages.engine.config import EngineConfig, SamplingParams
from kvflow.stages.engine.demo import PRESETS, write_demo_model
from kvflow.stages.engine.engine import Engine
from kvflow.stages.engine.errors import (
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    OutOfPagesError,
    PageLayoutError,
    UnknownRequestError,
)
from kvflow.stages.engine.grammar import GrammarCompiler, GrammarError, GrammarSpec
from kvflow.stages.engine.model_card import ModelCard
from kvflow.stages.engine.pages import KVLayout
from kvflow.stages.engine.sequence import RequestOutput, TokenLogprob
from kvflow.stages.engine.spec import ModelSpec
from kvflow.stages.engine.tokenizer import Tokenizer

__all__ = [
    "PRESETS",
    "Engine",
    "EngineConfig",
    "EngineError",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "InvalidRequestError",
    "KVLayout",
    "ModelCard",
    "ModelLoadError",
    "ModelSpec",
    "OutOfPagesError",
    "PageLayoutError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "Tokenizer",
    "UnknownRequestError",
    "write_demo_model",
]

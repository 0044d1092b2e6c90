"""What a model directory says beyond its weights, in one record: the served name, the
end-of-sequence ids (config.json and generation_config.json together), the BOS token, the
chat template and generation_config.json's sampling defaults.

An HTTP front reads everything it needs about the model from `engine.card`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.stages.engine.chat_template import ChatTemplate
from kvflow.stages.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return value


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's sampling defaults, for fields a request leaves unset (as
    vLLM applies them; `do_sample` is not consulted). None: the file does not say.

    Fields: temperature, top_k, top_p, repetition_penalty, max_tokens (its max_new_tokens).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GenerationDefaults:
        def num(key: str, kind: type) -> Any:
            value = cfg.get(key)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            return kind(value) if ok else None

        return cls(
            temperature=num("temperature", float),
            top_k=num("top_k", int),
            top_p=num("top_p", float),
            repetition_penalty=num("repetition_penalty", float),
            max_tokens=num("max_new_tokens", int),
        )

    def as_dict(self) -> dict[str, float | int]:
        """The defaults that are set, by SamplingParams field name."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class ModelCard:
    """Fields:
    name: the served model name (`--served-model-name`, else the directory's name).
    eos_token_ids: every id that ends a turn: config.json's eos_token_id, then
        generation_config.json's (a Llama-3-Instruct lists <|eot_id|> only there).
    bos_token_id: config.json's (else generation_config.json's) bos_token_id.
    chat_template: the directory's ChatTemplate, or None.
    generation: generation_config.json's sampling defaults.
    """

    name: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    chat_template: ChatTemplate | None = field(default=None, compare=False)
    generation: GenerationDefaults = GenerationDefaults()

    @classmethod
    def from_dir(cls, model_dir: str | Path, name: str | None = None) -> ModelCard:
        """Read config.json, generation_config.json and the chat template of `model_dir`.
        Missing optional files give empty fields; malformed ones raise ModelLoadError."""
        path = Path(model_dir)
        config = _read_json(path / "config.json")
        gen = _read_json(path / GENERATION_CONFIG)
        eos = tuple(dict.fromkeys(_ids(config.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
        bos = _ids(config.get("bos_token_id")) or _ids(gen.get("bos_token_id"))
        return cls(
            name=name or path.resolve().name,
            eos_token_ids=eos,
            bos_token_id=bos[0] if bos else None,
            chat_template=ChatTemplate.from_dir(path),
            generation=GenerationDefaults.from_config(gen),
        )

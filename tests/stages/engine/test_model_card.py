"""What a model directory says, honoured: chat templates render as transformers renders them,
EOS ids come from generation_config.json too, BOS is added where the tokenizer adds one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import processors

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams, write_demo_model
from kvflow.stages.engine.chat_template import ChatTemplate
from kvflow.stages.engine.demo import build_tokenizer
from kvflow.stages.engine.errors import ChatTemplateError
from kvflow.stages.engine.model_card import ModelCard

# A Llama-3-like template: bos_token, a system default, raise_exception on bad roles,
# loop controls, tojson over tools.
LLAMA3_LIKE = (
    "{{ bos_token }}{% if tools %}{{ 'Tools: ' + (tools | tojson) + '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'system' and not loop.first %}{% continue %}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|eot|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And <b>3+3</b>? \u00e9\u00e8 \U0001f642  "},
    ],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y"}],
]


def _model_dir(tmp_path: Path, template: str | None, as_file: bool = False) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    if template is not None and as_file:
        (out / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _transformers_render(model_dir: Path, messages, add_generation_prompt: bool, **kw) -> str:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
    )


@pytest.mark.parametrize("as_file", [False, True], ids=["tokenizer_config", "jinja_file"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tmp_path: Path, as_file: bool, add_generation_prompt: bool):
    model_dir = _model_dir(tmp_path, LLAMA3_LIKE, as_file)
    template = ChatTemplate.from_dir(model_dir)
    assert template is not None
    for messages in CONVERSATIONS:
        ours = template.render(messages, add_generation_prompt=add_generation_prompt)
        assert ours == _transformers_render(model_dir, messages, add_generation_prompt)
        assert ours.startswith("<s><|start|>")
    tools = [{"type": "function", "function": {"name": "f<x>", "parameters": {}}}]
    ours = template.render(CONVERSATIONS[0], add_generation_prompt, tools=tools)
    assert ours == _transformers_render(
        model_dir, CONVERSATIONS[0], add_generation_prompt, tools=tools
    )
    assert '"f<x>"' in ours  # tojson does not HTML-escape


def test_default_model_template_matches_transformers(smol_dir: Path) -> None:
    template = ChatTemplate.from_dir(smol_dir)
    assert template is not None
    for messages in CONVERSATIONS:
        for agp in (True, False):
            assert template.render(messages, agp) == _transformers_render(smol_dir, messages, agp)
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text


def test_template_errors_and_absence(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, LLAMA3_LIKE)
    template = ChatTemplate.from_dir(model_dir)
    assert template is not None
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        template.render([])
    with pytest.raises(ChatTemplateError):
        template.render(["not a dict"])  # type: ignore[list-item]
    shutil.rmtree(model_dir)
    assert ChatTemplate.from_dir(_model_dir(tmp_path, None)) is None


def test_named_templates(tmp_path: Path) -> None:
    out = _model_dir(tmp_path, None)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_dir(out)
    assert template is not None
    assert template.render([{"role": "user", "content": "a"}]) == "Da"
    assert template.render([{"role": "user", "content": "a"}], tools=[{"x": 1}]) == "T1"


def test_eos_from_generation_config_stops_generation(tmp_path: Path) -> None:
    model_dir = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    prompt = [5, 6, 7, 8]
    free = Engine.open(model_dir, EngineConfig(num_pages=16, block_size=8))
    tokens = free.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert len(tokens) == 8 and 2 not in tokens
    stopper = tokens[0]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stopper]}))
    engine = Engine.open(model_dir, EngineConfig(num_pages=16, block_size=8))
    assert engine.card.eos_token_ids == (2, stopper)
    assert engine.card.name == "tiny"
    assert engine.generate([prompt], SamplingParams(max_tokens=8))[0] == tokens[:1]
    ignoring = SamplingParams(max_tokens=8, ignore_eos=True)
    assert engine.generate([prompt], ignoring)[0] == tokens


def test_generation_defaults(tmp_path: Path) -> None:
    model_dir = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    gen = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_new_tokens": 256,
        "do_sample": True,
        "bos_token_id": 1,
    }
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    card = ModelCard.from_dir(model_dir, name="served")
    assert card.name == "served"
    assert card.generation.as_dict() == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "max_tokens": 256,
    }
    SamplingParams(**card.generation.as_dict())  # the names are SamplingParams fields
    (model_dir / "generation_config.json").write_text("{not json")
    with pytest.raises(Exception, match="not valid JSON"):
        ModelCard.from_dir(model_dir)


def test_bos_added_to_text_prompts_where_the_tokenizer_adds_one(tmp_path: Path) -> None:
    model_dir = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    engine = Engine.open(model_dir, EngineConfig(num_pages=4))
    assert engine.tokenizer.encode_prompt("hi") == engine.tokenizer.encode("hi")  # adds none
    tok = build_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(model_dir / "tokenizer.json"))
    engine = Engine.open(model_dir, EngineConfig(num_pages=4))
    assert engine.tokenizer.encode_prompt("hi") == [1, *engine.tokenizer.encode("hi")]

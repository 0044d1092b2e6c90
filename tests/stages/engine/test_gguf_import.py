"""GGUF import: the default model's file read by our reader matches transformers' GGUF loader
(logits within 1e-4 in float32), and the import's edges fail with useful errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.stages.engine import Engine, EngineConfig, ModelLoadError, SamplingParams
from kvflow.stages.engine.default_model import default_gguf_path, ensure_default_model
from kvflow.stages.engine.gguf_import import import_gguf
from kvflow.stages.engine.gguf_reader import unpermute_rows


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (the operation to undo)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * 64, 40)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rows(permuted, n_head), w)


def test_engine_open_on_gguf_says_what_to_do() -> None:
    with pytest.raises(ModelLoadError, match="kvflow model import-gguf"):
        Engine.open(default_gguf_path())


def test_import_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        import_gguf(junk, tmp_path / "out")
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        import_gguf(default_gguf_path(), tmp_path / "exists")
    assert not (tmp_path / "out").exists()


def test_default_model_directory(smol_dir: Path) -> None:
    assert smol_dir.name == "SmolLM2-135M-Instruct"
    names = {p.name for p in smol_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    tok_config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    # a second call finds it and imports nothing
    lines: list[str] = []
    assert ensure_default_model(smol_dir.parent.parent, progress=lines.append) == smol_dir
    assert lines == []


@pytest.fixture(scope="module")
def hf_gguf() -> tuple[object, object]:
    """transformers' own GGUF loader on the same file: (model, tokenizer), float32."""
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(smol_dir: Path, hf_gguf) -> None:
    model, _ = hf_gguf
    engine = Engine.open(
        smol_dir, EngineConfig(dtype="float32", block_size=16, num_pages=64, return_logits=True)
    )
    ids = engine.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    engine.add_request("r", ids, SamplingParams(max_tokens=12))
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.logits is not None)
    generated = [o.new_token_ids[0] for o in outs]
    ours = torch.cat([o.logits for o in outs])
    with torch.no_grad():
        ref = model(torch.tensor([ids + generated[:-1]])).logits[0, len(ids) - 1 :].float()
    assert ours.shape == ref.shape == (12, 49152)
    assert (ours - ref).abs().max().item() < 1e-4
    assert "Berlin" in engine.tokenizer.decode(generated)  # a real model, not a random one


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_loader(smol_dir: Path, hf_gguf) -> None:
    _, hf_tok = hf_gguf
    engine_tok = Engine.open(smol_dir, EngineConfig(num_pages=1)).tokenizer
    texts = [
        "Hello, world! How are you today?",
        "<|im_start|>user\nWhat is KV caching?<|im_end|>\n<|im_start|>assistant\n",
        "naïve café — ünïcödé and emoji 🙂 and 中文",
        "  leading spaces,\ttabs\nand newlines\n\n",
    ]
    for text in texts:
        ours = engine_tok.encode(text, add_special_tokens=True)
        assert ours == hf_tok(text)["input_ids"], text
        assert engine_tok.decode(ours, skip_special_tokens=False) == text
    # SmolLM's own tokenizer (and llama.cpp's "smollm" pre-tokenizer) split digits one by
    # one; transformers' GGUF loader does not know that pre-tokenizer, so only we do.
    digits = engine_tok.encode("2024")
    assert [engine_tok.decode([t]) for t in digits] == ["2", "0", "2", "4"]

"""Demo model writer, the demo-model command, fingerprints and the KV layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.stages.engine import PRESETS, Engine, EngineConfig, write_demo_model
from kvflow.stages.engine.demo import build_tokenizer, demo_config
from kvflow.stages.engine.spec import spec_from_config
from kvflow.tools.cli import main


def test_demo_model_is_seeded(tmp_path: Path, tiny_dir: Path) -> None:
    same = write_demo_model(tmp_path / "same", "tiny", seed=0)
    other = write_demo_model(tmp_path / "other", "tiny", seed=1)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (same / name).read_bytes() == (tiny_dir / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (same / "model.safetensors").read_bytes()


def test_small_preset_shape() -> None:
    spec = spec_from_config(demo_config(PRESETS["small"]))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (1024, 8, 8, 2)
    assert spec.intermediate_size == 2816
    assert 140e6 < spec.num_params < 170e6
    assert spec.max_position_embeddings >= 16384


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="preset"):
        write_demo_model("/nonexistent", "huge")


def test_demo_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo-model", "--out", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"]) == 0
    )
    assert "tiny demo model" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    engine = Engine.open(tmp_path / "m")
    assert engine.generate([[3, 4]], None)[0]


def test_byte_tokenizer_roundtrip(tiny_dir: Path) -> None:
    engine = Engine.open(tiny_dir)
    text = "héllo, wörld 🙂 tabs\tand\nnewlines"
    ids = engine.tokenizer.encode(text)
    assert engine.tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode())
    assert build_tokenizer().token_to_id("</s>") == engine.eos_token_id == 2


def test_fingerprint_and_layout(tiny_dir: Path, tmp_path: Path) -> None:
    a = Engine.open(tiny_dir, EngineConfig(block_size=16))
    b = Engine.open(tiny_dir, EngineConfig(block_size=16))
    c = Engine.open(tiny_dir, EngineConfig(dtype="bfloat16"))
    other = Engine.open(write_demo_model(tmp_path / "o", "tiny", seed=1))
    assert a.model_fingerprint == b.model_fingerprint
    assert a.model_fingerprint != c.model_fingerprint
    # Same shapes and header, different weights: the sampled weight bytes tell them apart.
    assert other.model_fingerprint != a.model_fingerprint
    assert a.kv_layout.page_shape == a.page_shape == (2, 2, 2, 16, 16)
    assert a.page_nbytes == 2 * 2 * 2 * 16 * 16 * 4
    assert c.page_nbytes == 2 * 2 * 2 * 64 * 16 * 2


def test_bf16_and_fp16_run(tiny_dir: Path) -> None:
    for dtype in ("bfloat16", "float16"):
        engine = Engine.open(tiny_dir, EngineConfig(dtype=dtype, block_size=8))
        engine.add_request("r", list(range(3, 30)), None, retain_pages=True)
        while engine.has_unfinished():
            engine.step()
        assert engine.export_page("r", 0).dtype == engine.page_dtype


def test_demo_tokenizer_gives_every_model_id_visible_text():
    tok = build_tokenizer(vocab_size=600)
    assert tok.get_vocab_size() == 600
    words = [tok.decode([i]) for i in range(259, 600)]
    assert all(w.startswith(" ") and w.strip().isalpha() for w in words)
    assert len(set(words)) == len(words)
    # Encoding is unchanged: plain bytes, never the pseudo words.
    assert max(tok.encode("hello world, " * 5).ids) < 259

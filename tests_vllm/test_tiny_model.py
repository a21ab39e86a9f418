"""The tiny model builds deterministically: a fresh build is byte-identical to the cached one the servers use."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.vllm_servers import build_model, ensure_model, ensure_venv


def test_fresh_build_is_byte_identical_to_the_cached_model(tmp_path: Path) -> None:
    venv = ensure_venv()
    cached = ensure_model(venv)
    fresh = tmp_path / "model"
    build_model(venv, fresh)

    names = sorted(p.name for p in cached.iterdir())
    assert names == sorted(p.name for p in fresh.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (fresh / name).read_bytes() == (cached / name).read_bytes(), f"{name} differs between builds"

    config = json.loads((fresh / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 256, 2)
    assert (config["num_attention_heads"], config["intermediate_size"]) == (4, 512)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (4096, 2048)
    tok_config = json.loads((fresh / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|assistant|>" in tok_config["chat_template"]
    vocab = json.loads((fresh / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 4096

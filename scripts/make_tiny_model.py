"""Build a tiny, fully local Llama model directory that real vLLM can serve (for the tests_vllm e2e suite).

Run with the vLLM venv's python (it has torch, tokenizers and safetensors):

    $VLLM_VENV/bin/python scripts/make_tiny_model.py OUTDIR

Architecture, tokenizer and special tokens follow docs/reference/vllm-cpu.md §2: Llama, hidden 256,
2 layers, 4 heads, intermediate 512, vocab 4096, 2048 positions; seeded random fp32 weights; a byte-level BPE
trained on this interpreter's stdlib sources. Nothing is downloaded. Two runs write byte-identical files.
The output text is gibberish; token counts, finish reasons, usage and streaming are real.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One rayon thread keeps BPE training order-independent (and leaves the second core to others).
os.environ.setdefault("RAYON_NUM_THREADS", "1")

SEED = 1234
VOCAB_SIZE = 4096
HIDDEN = 256
LAYERS = 2
HEADS = 4
INTERMEDIATE = 512
MAX_POSITIONS = 2048
CORPUS_BYTES = 8 * 1024 * 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
BOS, EOS, UNK, PAD = SPECIAL_TOKENS[:4]

# Roles map onto the <|role|> special tokens; every turn ends with <|end|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% elif message['content'] is none %}{% set text = '' %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ text }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files() -> list[Path]:
    """The stdlib's *.py files in a fixed order (sorted relative paths), capped at CORPUS_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    chosen: list[Path] = []
    total = 0
    for path in files:
        if total >= CORPUS_BYTES:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def corpus_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(files), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama convention: plain encodes start with <s> (chat prompts get it from the template instead).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def random_weights(seed: int) -> dict:
    """Seeded N(0, 0.02) matrices and unit norms under the HF Llama parameter names."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int):
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02).contiguous()

    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[p + f"self_attn.{name}.weight"] = normal(HIDDEN, HIDDEN)
        weights[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        weights[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    weights["model.norm.weight"] = torch.ones(HIDDEN)
    weights["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN)
    return weights


def model_config(tok) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }


def tokenizer_config() -> dict:
    return {
        # Forced so the files also load under transformers 4.x (docs/reference/vllm-cpu.md §2).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": SPECIAL_TOKENS[4:],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build(outdir: Path) -> None:
    from safetensors.torch import save_file

    outdir.mkdir(parents=True, exist_ok=True)
    files = corpus_files()
    tok = build_tokenizer(files)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    tok.save(str(outdir / "tokenizer.json"))
    write_json(outdir / "tokenizer_config.json", tokenizer_config())
    write_json(
        outdir / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
         "additional_special_tokens": SPECIAL_TOKENS[4:]},
    )
    (outdir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    config = model_config(tok)
    write_json(outdir / "config.json", config)
    write_json(
        outdir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]},
    )
    save_file(random_weights(SEED), str(outdir / "model.safetensors"), metadata={"format": "pt"})
    print(f"tiny model written to {outdir} (tokenizer trained on {len(files)} stdlib files)", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_tiny_model.py OUTDIR", file=sys.stderr)
        return 2
    build(Path(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

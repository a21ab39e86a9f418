"""A LoRA adapter of the tiny model (scripts/make_tiny_model.py), written the way PEFT saves one, with numpy only.

vLLM 0.32 reads an adapter directory as PEFT's (vllm/lora/peft_helper.py, vllm/lora/lora_model.py): an
`adapter_config.json` with `r`, `lora_alpha` and `target_modules`, and an `adapter_model.safetensors` whose tensors
are named `base_model.model.<module>.lora_A.weight` (shape [r, in]) and `...lora_B.weight` (shape [out, r]); a
tensor of a module outside the model's LoRA-capable modules is refused at load. safetensors is a little-endian
u64 header length, a JSON header (dtype, shape, byte offsets per tensor) and the raw bytes, so no library is
needed to write one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

RANK = 8
TARGETS = ("q_proj", "v_proj")


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """`tensors` (float32) in the safetensors format."""
    header: dict[str, object] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # the data starts 8-byte aligned
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))


def make_adapter(outdir: Path, model_dir: Path, rank: int = RANK, seed: int = 0) -> Path:
    """An adapter of `rank` on every layer's q_proj and v_proj of the model in `model_dir`; random A and B, so
    its outputs differ from the base model's. Returns `outdir`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim,
            "v_proj": cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[prefix + ".lora_A.weight"] = rng.normal(0.0, 0.5, (rank, hidden))
            tensors[prefix + ".lora_B.weight"] = rng.normal(0.0, 0.5, (outs[module], rank))
    outdir.mkdir(parents=True, exist_ok=True)
    write_safetensors(outdir / "adapter_model.safetensors", tensors)
    (outdir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "fan_in_fan_out": False, "inference_mode": True}, indent=1))
    return outdir

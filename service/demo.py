"""A small, realistic demonstration checkpoint, so ``weightserve serve --demo`` shows the
product working with nothing else installed: a 4-layer decoder in safetensors (bfloat16
weights, float32 norms, an int64 buffer) and the same shape in GGUF with Q8_0 blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

DEMO_MODEL = "demo/tiny-llama"
DEMO_GGUF = "demo/tiny-llama-q8_0.gguf"


def default_cache_dir() -> Path:
    env = os.environ.get("WEIGHTSERVE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "weightserve"


def demo_tensors(layers: int = 4, hidden: int = 256, vocab: int = 1024) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(20261121)
    bf16 = ml_dtypes.bfloat16

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(bf16)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
        "lm_head.weight": w(vocab, hidden),
        "model.rotary_emb.position_ids": np.arange(128, dtype=np.int64),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{p}.self_attn.q_proj.weight": w(hidden, hidden),
            f"{p}.self_attn.k_proj.weight": w(hidden // 4, hidden),
            f"{p}.self_attn.v_proj.weight": w(hidden // 4, hidden),
            f"{p}.self_attn.o_proj.weight": w(hidden, hidden),
            f"{p}.post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{p}.mlp.gate_proj.weight": w(hidden * 4, hidden),
            f"{p}.mlp.up_proj.weight": w(hidden * 4, hidden),
            f"{p}.mlp.down_proj.weight": w(hidden, hidden * 4),
        }
    return tensors


def write_demo(root: Path) -> Path:
    """Write the demo models under ``root`` (once; later calls reuse them). Returns root."""
    from safetensors.numpy import save_file

    model_dir = root / DEMO_MODEL
    target = model_dir / "model.safetensors"
    if not target.exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        save_file(demo_tensors(), str(tmp), metadata={"format": "pt", "source": "weightserve demo"})
        tmp.rename(target)  # atomic: a half-written demo is never served
    gguf_path = root / DEMO_GGUF
    if not gguf_path.exists():
        _write_demo_gguf(gguf_path)
    return root


def _write_demo_gguf(path: Path) -> None:
    import logging

    import gguf
    from gguf.quants import quantize

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file at INFO

    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("tiny-llama demo")
    writer.add_block_count(4)
    writer.add_context_length(128)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(64)])
    for name, arr in demo_tensors().items():
        gguf_name = name.replace("model.", "", 1)
        if arr.dtype == np.int64:
            continue
        data = arr.astype(np.float32)
        if data.ndim == 2:
            q = quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)

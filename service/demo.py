"""Small, realistic demonstration checkpoints, so ``weightserve serve --demo`` shows the
product working with nothing else installed:

- ``demo/tiny-llama``: a 4-layer decoder in safetensors (bfloat16 weights, float32 norms, an
  int64 buffer), and ``demo/tiny-llama-q8_0.gguf``, the same shape in GGUF with Q8_0 blocks;
- ``demo/tiny-lm``: a complete causal language model an engine can run (a Llama
  ``config.json``, a byte-level tokenizer, ``generation_config.json``, float32 weights, which
  MAX runs on CPU). Its weights are random, so its text is noise: it shows the path (engine,
  config, tokenizer, weights over the network), not a model's quality.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

DEMO_MODEL = "demo/tiny-llama"
DEMO_GGUF = "demo/tiny-llama-q8_0.gguf"
DEMO_LM = "demo/tiny-lm"


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
    if not (root / DEMO_LM / "model.safetensors").exists():
        write_demo_lm(root / DEMO_LM)
    return root


# The demo language model's shape: a Llama small enough to write in a blink and to compile
# quickly, with grouped-query attention as real models have.
LM_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _byte_symbols() -> list[str]:
    """The printable stand-in of each byte that byte-level BPE tokenizers (GPT-2's scheme)
    use as its token's text."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def demo_lm_tokenizer() -> dict[str, Any]:
    """A byte-level tokenizer in the ``tokenizers`` JSON format: one token per byte (no
    merges), the begin and end tokens after them. Any text round-trips."""

    def special(token_id: int, content: str) -> dict[str, Any]:
        return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}  # fmt: skip

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [special(256, BOS), special(257, EOS)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": BOS, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": BOS, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [256], "tokens": [BOS]}},
        },  # fmt: skip
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbol: i for i, symbol in enumerate(_byte_symbols())},
            "merges": [],
        },
    }


def demo_lm_tensors() -> dict[str, np.ndarray]:
    """Random float32 weights of ``LM_CONFIG``'s shape. Only printable ASCII tokens get
    output weights (the other rows of ``lm_head`` are zero, so their logit is 0 while the
    best printable one is positive), so greedy text is readable noise and never ends early."""
    c = LM_CONFIG
    rng = np.random.default_rng(20261201)
    hidden, inner, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]

    def w(*shape: int, scale: float = 0.05) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    lm_head = w(vocab, hidden, scale=0.3)
    printable = np.zeros(vocab, dtype=bool)
    printable[ord(" ") : ord("~") + 1] = True
    lm_head[~printable] = 0
    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden, scale=1.0),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
        "lm_head.weight": lm_head,
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{p}.self_attn.q_proj.weight": w(hidden, hidden),
            f"{p}.self_attn.k_proj.weight": w(kv, hidden),
            f"{p}.self_attn.v_proj.weight": w(kv, hidden),
            f"{p}.self_attn.o_proj.weight": w(hidden, hidden),
            f"{p}.post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{p}.mlp.gate_proj.weight": w(inner, hidden),
            f"{p}.mlp.up_proj.weight": w(inner, hidden),
            f"{p}.mlp.down_proj.weight": w(hidden, inner),
        }
    return tensors


def write_demo_lm(model_dir: Path) -> None:
    """The demo language model's repository, as a Hugging Face model repository lays it out:
    side files first, the weights last and atomically (their presence means complete)."""
    from safetensors.numpy import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    side_files = {
        "config.json": LM_CONFIG,
        "generation_config.json": {
            "bos_token_id": LM_CONFIG["bos_token_id"],
            "eos_token_id": LM_CONFIG["eos_token_id"],
            "do_sample": False,
        },
        "tokenizer.json": demo_lm_tokenizer(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "add_bos_token": True,
            "model_max_length": LM_CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS},
    }
    for name, body in side_files.items():
        (model_dir / name).write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n")
    target = model_dir / "model.safetensors"
    tmp = target.with_suffix(".tmp")
    save_file(demo_lm_tensors(), str(tmp), metadata={"format": "pt", "source": "weightserve demo"})
    tmp.rename(target)


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

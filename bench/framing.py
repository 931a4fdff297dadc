"""``python -m bench.framing``: what framing one chunk costs, on each side of the wire: the
server's ``chunk_message`` and the client's in-place ``ArrowChunkReader``, each against a
reference measured in the same run.

Everything runs in this process from memory (``io.BytesIO``): no sockets, no files. Each round
measures, and the table gives the medians over rounds with these ratios:

- ``chunk_message`` of a small tensor's chunk with its fixed part cached, and built afresh (the
  first chunk of a tensor): first / cached;
- reading a stream of small chunks: ``ArrowChunkReader`` per chunk, and pyarrow's
  ``RecordBatchStreamReader`` per batch of the same bytes: ours / pyarrow's;
- reading 5 MiB chunks into a caller's buffer: ``ArrowChunkReader`` GB/s, and ``readinto`` of
  the same bytes (the ceiling: one copy, no framing): ours / ceiling.

Results go to ``bench/results/framing-latest.json``.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import xxhash

from bench import report
from bench.checkpoint import REPO, RESULTS_DIR
from bench.procs import write_json_atomically as write_json
from weightserve.client.receive.arrow_reader import ArrowChunkReader
from weightserve.client.wire.schema import ChunkHeader
from weightserve.service.serving import arrow_writer
from weightserve.service.serving.arrow_writer import END_OF_STREAM, chunk_message, schema_message

RESULTS = RESULTS_DIR / "framing-latest.json"
BIG_CHUNK = 5 << 20


def _chunk(name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> tuple[ChunkHeader, bytes]:
    header = ChunkHeader(
        name, dtype, shape, shape, None, 0, len(data), xxhash.xxh3_64_intdigest(data), len(data)
    )
    return header, data


def _stream(chunks: list[tuple[ChunkHeader, bytes]]) -> bytes:
    parts = [schema_message()]
    for header, data in chunks:
        prefix, suffix = chunk_message(header)
        parts += (prefix, data, suffix)
    parts.append(END_OF_STREAM)
    return b"".join(parts)


def _per_call(n: int, work: Callable[[], object]) -> float:
    """Seconds per call of ``work``, over ``n`` calls."""
    started = time.perf_counter()
    for _ in range(n):
        work()
    return (time.perf_counter() - started) / n


def one_round(n: int) -> dict[str, float]:
    """One measurement of each: seconds per small chunk, bytes per second for big chunks."""
    rng = random.Random(0)
    small = _chunk("model.embed_tokens.weight", "float32", (2, 3), rng.randbytes(24))
    big = _chunk("big", "uint8", (BIG_CHUNK,), rng.randbytes(BIG_CHUNK))
    header = small[0]
    out: dict[str, float] = {}

    out["chunk_message_cached_s"] = _per_call(n, lambda: chunk_message(header))

    def fresh() -> None:
        arrow_writer._FIXED_CACHE.clear()  # what the first chunk of a tensor meets
        chunk_message(header)

    out["chunk_message_first_s"] = _per_call(max(1, n // 4), fresh)

    stream = _stream([small] * n)
    into = memoryview(bytearray(header.nbytes))
    reader = ArrowChunkReader(io.BytesIO(stream))
    reader.read_schema()
    started = time.perf_counter()
    count = sum(1 for _ in reader.chunks(lambda h: into))
    out["reader_small_s"] = (time.perf_counter() - started) / count
    started = time.perf_counter()
    batches = sum(1 for _ in pa.ipc.open_stream(io.BytesIO(stream)))
    out["pyarrow_small_s"] = (time.perf_counter() - started) / batches

    repeats = 20
    big_stream = _stream([big])
    dest = memoryview(bytearray(BIG_CHUNK))
    started = time.perf_counter()
    for _ in range(repeats):
        for _ in ArrowChunkReader(io.BytesIO(big_stream)).chunks(lambda h: dest):
            pass
    out["reader_big_bps"] = repeats * BIG_CHUNK / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(repeats):
        io.BytesIO(big_stream).readinto(dest)
    out["readinto_big_bps"] = repeats * BIG_CHUNK / (time.perf_counter() - started)
    return out


def summarize(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over rounds and the three ratios the module docstring names."""
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {
        "medians": median,
        "ratios": {
            "chunk_message_first_over_cached": median["chunk_message_first_s"]
            / median["chunk_message_cached_s"],
            "reader_small_over_pyarrow": median["reader_small_s"] / median["pyarrow_small_s"],
            "reader_big_over_readinto": median["reader_big_bps"] / median["readinto_big_bps"],
        },
    }


def table(summary: dict[str, Any]) -> str:
    m, r = summary["medians"], summary["ratios"]
    us = 1e6
    return "\n".join(
        [
            f"chunk_message, fixed part cached   {m['chunk_message_cached_s'] * us:8.2f} us",
            f"chunk_message, first of a tensor   {m['chunk_message_first_s'] * us:8.2f} us"
            f"   x{r['chunk_message_first_over_cached']:.2f} of cached",
            f"ArrowChunkReader, small chunk      {m['reader_small_s'] * us:8.2f} us",
            f"pyarrow stream reader, same bytes  {m['pyarrow_small_s'] * us:8.2f} us"
            f"   ours x{r['reader_small_over_pyarrow']:.2f} of pyarrow's",
            f"ArrowChunkReader, 5 MiB chunks     {m['reader_big_bps'] / 1e9:8.2f} GB/s",
            f"readinto, same bytes (ceiling)     {m['readinto_big_bps'] / 1e9:8.2f} GB/s"
            f"   ours {r['reader_big_over_readinto']:.2f} of the ceiling",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.framing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick: 1)")
    p.add_argument("--chunks", type=int, default=20000, help="small chunks per measurement")
    p.add_argument("--quick", action="store_true", help="one short round (CI)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    n = 200 if args.quick else args.chunks
    summary = summarize([one_round(n) for _ in range(rounds)])
    results = {
        "machine": report.machine(),
        "config": {
            "command": report.command("bench.framing", argv),
            "rounds": rounds,
            "small_chunks": n,
            "big_chunk_bytes": BIG_CHUNK,
        },
        **summary,
    }
    write_json(args.out, results)
    print(table(summary))
    report.print_saved(args.out, REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Statistics over rounds, ratios to the ceilings, goals, the printed table, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20


def summarize(rounds: list[dict]) -> dict[str, Any]:
    """Median and min-max over rounds of a contender's measurements."""
    seconds = [r["seconds"] for r in rounds]
    out: dict[str, Any] = {
        "rounds": len(rounds),
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "bytes": rounds[0]["bytes"],
    }
    rates = [r["bytes"] / r["seconds"] for r in rounds if r["seconds"] > 0]
    out["gbps"] = statistics.median(rates) / 1e9 if rates else 0.0
    out["gbps_min"] = min(rates) / 1e9 if rates else 0.0
    out["gbps_max"] = max(rates) / 1e9 if rates else 0.0
    workers = [w for r in rounds for w in r["results"]]
    out["clients"] = len(rounds[0]["results"])
    out["peak_rss"] = statistics.median(max(w["peak_rss"] for w in r["results"]) for r in rounds)
    out["rss_before"] = statistics.median(w["rss_before"] for w in workers)
    impl = {w.get("impl") for w in workers} - {None}
    if impl:
        out["impl"] = ",".join(sorted(impl))
    if "p50_ms" in workers[0]:
        out["p50_ms"] = statistics.median(w["p50_ms"] for w in workers)
        out["p99_ms"] = statistics.median(w["p99_ms"] for w in workers)
        out["p99_ms_max"] = max(w["p99_ms"] for w in workers)
    if "requests" in workers[0]:
        out["requests"] = sum(w["requests"] for w in rounds[0]["results"])
        out["requests_per_s"] = statistics.median(
            sum(w["requests"] for w in r["results"]) / r["seconds"] for r in rounds
        )
    # CPU seconds per GiB moved (medians): where the work is, client and server, user/system.
    gib = rounds[0]["bytes"] / (1 << 30) if rounds[0]["bytes"] else 0
    for side in ("client", "server"):
        for kind in ("user", "sys"):
            key = f"{side}_cpu_{kind}_s"
            if gib and key in rounds[0]:
                out[f"{side}_cpu_{kind}_s_per_gib"] = (
                    statistics.median(r[key] for r in rounds) / gib
                )
    if "server_anon_growth" in rounds[0]:
        out["server_anon_before"] = statistics.median(r["server_anon_before"] for r in rounds)
        out["server_anon_peak"] = max(r["server_anon_peak"] for r in rounds)
        out["server_anon_growth"] = max(r["server_anon_growth"] for r in rounds)
    return out


def goal(name: str, measured: float, target: float, *, at_most: bool = False, unit: str = ""):
    met = measured <= target if at_most else measured >= target
    if at_most:
        miss = "" if met else f"{measured / target:.2f}x the limit ({measured - target:+.3g}{unit})"
    else:
        miss = (
            "" if met else f"{measured / target:.2f} of the target ({measured - target:+.3g}{unit})"
        )
    return {
        "goal": name,
        "target": target,
        "measured": measured,
        "met": met,
        "relation": "<=" if at_most else ">=",
        "missed_by": miss,
        "unit": unit,
    }


def command(module: str, argv: list[str] | None) -> str:
    """The command line a result records: absolute paths (``--out``, a checkpoint) by their
    file name only, so a saved result names no directory of the machine that ran it."""
    args = argv if argv is not None else sys.argv[1:]
    return " ".join(["python", "-m", module, *(_file_name_only(a) for a in args)])


def _file_name_only(arg: str) -> str:
    key, sep, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if value.startswith("/"):
        value = os.path.basename(value.rstrip("/")) or value
    return key + sep + value


def _noise(config: dict[str, Any]) -> str:
    """The run's load average (start, end) and steal, for reading its spread."""
    load, steal = config.get("loadavg_1min"), config.get("steal_fraction")
    out = f"; load average {load[0]}-{load[1]}" if load else ""
    return out + (f", steal {steal:.1%}" if steal is not None else "")


def cpu_ticks() -> tuple[int, int] | None:
    """(all, stolen) CPU ticks since boot from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is within user)
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def steal_fraction(before: tuple[int, int] | None) -> float | None:
    """The share of this machine's CPU time the hypervisor gave to others since ``before``
    (``cpu_ticks()``): on a shared VM, noise no ordering of rounds removes."""
    after = cpu_ticks()
    if before is None or after is None or after[0] <= before[0]:
        return None
    return round((after[1] - before[1]) / (after[0] - before[0]), 4)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for pkg in ("numpy", "pyarrow", "grpcio", "uvicorn", "httptools", "uvloop", "fastapi", "h11",
                "safetensors", "torch", "max"):  # fmt: skip
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - absent package
            versions[pkg] = None
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(mem / (1 << 30), 1),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "packages": versions,
        "git": _git_head(),
        # uvicorn's "auto" HTTP protocol: httptools when importable, else h11 (which copies
        # every body piece once more before writing it)
        "uvicorn_http": "httptools" if versions.get("httptools") else "h11",
        "uvicorn_loop": "uvloop" if versions.get("uvloop") else "asyncio",
    }


def _git_head() -> str | None:
    """HEAD, with ``+dirty`` when service/ or client/ hold uncommitted changes (measured)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "service", "client"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def table(results: dict[str, Any]) -> str:
    """The human table: throughput contenders, then partial loads, memory, small requests."""
    c = results["contenders"]
    ceiling = results["ceiling"]["gbps"]
    pagecache = c.get("pagecache_read", {}).get("gbps", float("nan"))
    machine = results.get("machine", {})
    lines = [
        # The same VM lands on different hosts, whose per-byte costs differ by up to 2x
        # (docs/performance.md, "Round 4"): ratios are only comparable on one CPU.
        f"machine: {machine.get('cpu', '?')}, {machine.get('nproc', '?')} CPUs, "
        f"kernel {machine.get('kernel', '?')}, tree {machine.get('git', '?')}",
        f"checkpoint: {results['checkpoint']['tensors']} tensors, "
        f"{results['checkpoint']['bytes'] / (1 << 30):.2f} GiB bf16; "
        f"{results['config']['rounds']} rounds, alternating; median [min-max]"
        + _noise(results["config"]),
        f"ceiling (best raw loopback TCP): {ceiling:.2f} GB/s ({results['ceiling']['key']}); "
        f"page cache: {pagecache:.2f} GB/s; static web server: {results['config']['static_server']}",
        "x4 rows: aggregate GB/s of 4 client processes; 'x ceil' there is against the best "
        f"4 raw streams ({results['ceiling_conc4']['key']})",
        "'x verif': against the best raw row that also hashes every 2 MiB as it lands "
        "(xxh3, as the client checks each chunk): "
        + str(results.get("ceiling_verified", {}).get("key") or "none run"),
        "",
        f"{'contender':<40} {'seconds':>22} {'GB/s':>7} {'x ceil':>7} {'x verif':>7} "
        f"{'peak RSS':>10}",
    ]
    for key, s in c.items():
        if "p50_ms" in s or "requests_per_s" in s:
            continue
        span = f"{s['median_s']:.3f} [{s['min_s']:.3f}-{s['max_s']:.3f}]"
        rss = f"{s['peak_rss'] / MiB:.0f} MiB"
        ratio = s.get("ratio_to_ceiling", s.get("ratio_to_raw_conc4"))
        verified = s.get("ratio_to_verified_ceiling", s.get("ratio_to_verified_conc4"))
        label = key + (f" x{s['clients']}" if s["clients"] > 1 else "")
        lines.append(
            f"{label:<40} {span:>22} {s['gbps']:>7.2f} "
            f"{(f'{ratio:.2f}' if ratio is not None else ''):>7} "
            f"{(f'{verified:.2f}' if verified is not None else ''):>7} {rss:>10}"
        )
    lines.append("")
    for key, s in c.items():
        if "p50_ms" in s and s["clients"] == 1:
            lines.append(
                f"{key:<34} p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  "
                f"({s['requests']} sequential requests, {s['requests_per_s']:.0f}/s)"
            )
        elif "requests_per_s" in s:
            lines.append(
                f"{key:<34} {s['requests_per_s']:.0f} requests/s with {s['clients']} clients"
                + (
                    f" (p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms)"
                    if "p50_ms" in s
                    else ""
                )
            )
    lines.append("")
    lines.append(
        "goals:"
        + (
            "  (--quick: a tiny checkpoint; these numbers mean nothing)"
            if results["config"]["quick"]
            else ""
        )
    )
    for g in results["goals"]:
        mark = "met " if g["met"] else "MISS"
        lines.append(
            f"  [{mark}] {g['goal']}: {g['measured']:.3g}{g['unit']} "
            f"{g['relation']} {g['target']:.3g}{g['unit']}"
            + (f"  -- {g['missed_by']}" if g["missed_by"] else "")
        )
    return "\n".join(lines)


def print_saved(path: Path, repo: Path) -> None:
    """Say where the JSON results went, relative to the repository when inside it."""
    try:
        shown = path.resolve().relative_to(repo)
    except ValueError:
        shown = path
    print(f"\nJSON: {shown}")

"""``weightserve cache prefetch|evict|verify URL ID[@R]``: an operator's controls of a node
cache, through its admin routes (``/v1/admin/cache/ID``; docs/origins.md, "Operators")."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from weightserve.client.wire.routes import RESERVED_PART

if TYPE_CHECKING:
    from weightserve.client.transports.http import HttpTransport

ADMIN_PATH = "/v1/admin/cache"
POLL_SECONDS = 0.5  # how often a prefetch's progress is asked for


def add_cache_parser(
    sub: Any,
    parser_class: type[argparse.ArgumentParser],
    token_help: str,
    retry: tuple[Callable[[str], float], str | None, str],
) -> None:
    """The ``cache`` subcommand and its actions, on the ``weightserve`` command's subparsers;
    ``retry`` is --retry-seconds' (type, default, help), as the other commands take it."""
    cache = sub.add_parser(
        "cache",
        help="warm, evict or re-verify a model in a node cache",
        description="Act on a node cache (a server whose ROOT is an origin): prefetch copies a "
        "model in without a load, evict removes it, verify re-checks its files against the "
        "origin. The server needs admin=PATTERN for the token in its token file; without a "
        "token file it answers only callers on its own node.",
    )
    actions = cache.add_subparsers(dest="action", required=True, parser_class=parser_class)
    helps = {
        "prefetch": "copy the model into the node's cache now, with a progress bar",
        "evict": "remove the model from the node's cache (refused while in use or pinned)",
        "verify": "re-check the cached files against the origin; a model that fails is evicted",
    }
    for action, text in helps.items():
        p = actions.add_parser(action, help=text, description=text)
        p.add_argument("url", help="the node's server, http://HOST:PORT")
        p.add_argument("model", metavar="ID[@R]", help="model id, optionally at a revision")
        p.add_argument("--token", default=None, help=token_help)
        p.add_argument("--retry-seconds", type=retry[0], default=retry[1], help=retry[2])
        if action == "prefetch":
            p.add_argument("--quiet", action="store_true", help="no progress bar")
            p.add_argument(
                "--no-wait", action="store_true", help="start the fill and return at once"
            )
        p.set_defaults(func=run_cache)


def admin_path(model_id: str, action: str | None = None) -> str:
    """``/v1/admin/cache/ID`` or ``/v1/admin/cache/ID/-/ACTION``."""
    path = f"{ADMIN_PATH}/{quote(model_id, safe='/@:')}"
    return f"{path}/{RESERVED_PART}/{action}" if action else path


def run_cache(args: argparse.Namespace) -> int:
    # Imported when run, as the other commands do: `weightserve --help` stays quick.
    from weightserve.client._retry import wait_for_server
    from weightserve.client.transports.base import Connection
    from weightserve.client.transports.http import HttpTransport
    from weightserve.client.wire.routes import parse_url

    try:
        address, in_url = parse_url(args.url)
    except ValueError as e:
        args.command_parser.error(str(e))
    if address.transport != "http" or in_url is not None:
        args.command_parser.error(f"give the node's server as http://HOST:PORT, not {args.url!r}")
    wait_for_server(address, args.retry_seconds)
    transport = HttpTransport(address, Connection(token=args.token or None))
    try:
        if args.action == "evict":
            done = transport.request_json("DELETE", admin_path(args.model))
            print(f"evicted {done['id']} ({done.get('evicted_bytes', 0)} bytes)")
            return 0
        if args.action == "verify":
            return _report_verify(transport.request_json("POST", admin_path(args.model, "verify")))
        state = transport.request_json("POST", admin_path(args.model, "prefetch"), ok=(202,))
        if not args.no_wait:
            state = _follow_fill(transport, args, state)
        print(f"{state['id']} {state['state']}")
        return 0 if state["state"] == "cached" or args.no_wait else 1
    finally:
        transport.close()


def _follow_fill(
    transport: HttpTransport, args: argparse.Namespace, state: dict[str, Any]
) -> dict[str, Any]:
    """Poll the model's state until the fill ends, drawing its progress on stderr."""
    from tqdm import tqdm

    with tqdm(
        total=state.get("bytes_total") or None,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=state["id"],
        disable=args.quiet or None,
        file=sys.stderr,
    ) as bar:
        while True:
            bar.total = state.get("bytes_total") or bar.total
            bar.update(max(0, int(state.get("bytes_done", 0)) - bar.n))
            if state["state"] != "filling":
                break
            time.sleep(POLL_SECONDS)
            state = transport.request_json("GET", admin_path(args.model))
    if state["state"] != "cached":
        reason = state.get("error") or "the fill ended without the model in the cache"
        print(f"weightserve cache prefetch: {state['id']}: {reason}", file=sys.stderr)
    return state


def _report_verify(result: dict[str, Any]) -> int:
    for f in result["files"]:
        detail = f" ({f['detail']})" if f.get("detail") else ""
        print(f"{f['status']:10} {f['name']}{detail}")
    if result["ok"]:
        print(f"{result['id']}: every file matches the origin")
        return 0
    outcome = (
        "evicted, the next request fills it again"
        if result["evicted"]
        else result.get("note", "not evicted")
    )
    print(f"{result['id']}: files differ from the origin; {outcome}")
    return 1

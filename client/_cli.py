"""The ``weightserve`` command: ``serve`` (needs the server extra), ``ls`` and ``pull``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightserve",
        description="Serve model weights as Arrow streams over HTTP and gRPC, and fetch them.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model root over HTTP and gRPC")
    try:
        from weightserve.service.cli import add_serve_arguments
    except ImportError:
        serve.set_defaults(func=_no_server)
    else:
        add_serve_arguments(serve)
        serve.set_defaults(func=_serve)
    return parser


def _no_server(args: argparse.Namespace) -> int:
    print(
        "weightserve serve needs the server extra: pip install 'weightserve[server]'",
        file=sys.stderr,
    )
    return 2


def _serve(args: argparse.Namespace) -> int:
    from weightserve.service.cli import run_serve

    return run_serve(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

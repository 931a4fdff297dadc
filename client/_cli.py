"""The ``weightserve`` command: ``serve`` (needs the server extra), ``ls``, ``pull``,
``publish``, ``watch``, ``cache`` (client/_cache_cli.py) and ``max`` (MAX's command line on a
model URL: client/max/command.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from weightserve.client._cache_cli import add_cache_parser
from weightserve.client._extras import install_hint
from weightserve.client._retry import COMMAND_START_SECONDS
from weightserve.client.arg_types import positive_int
from weightserve.client.errors import TOKEN_HINT_CLI, Unauthenticated, WeightserveError

_SERVER_EXTRA = install_hint("server")


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a usage mistake is one line that names the argument (the usage
    text, a dozen lines for ``serve``, would bury it), and the parser is in the namespace so
    ``main`` reports later mistakes the same way."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.set_defaults(command_parser=self)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _retry_seconds(text: str) -> float:
    """argparse type of --retry-seconds (its default comes from the environment, parsed too)."""
    from weightserve.client._retry import retry_seconds_from

    try:
        return retry_seconds_from(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"need a number of seconds >= 0 (0: never retry), got {text!r}"
        ) from None


def _verify(text: str) -> str:
    """argparse type of --verify (its default comes from the environment, checked too)."""
    from weightserve.client.receive.stream import VERIFY_CHOICES

    if text not in VERIFY_CHOICES:
        raise argparse.ArgumentTypeError(f"need one of {', '.join(VERIFY_CHOICES)}, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightserve",
        description="Serve model weights as Arrow streams over HTTP, gRPC and Arrow Flight, and fetch them.",
    )
    parser.add_argument(
        "--version", "-V", action="version", version=f"weightserve {_package_version()}"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    serve = sub.add_parser(
        "serve",
        help="serve a model root over HTTP, gRPC and Arrow Flight",
        description="Serve every model under ROOT over HTTP, gRPC and Arrow Flight.",
    )
    try:
        from weightserve.service.config import add_serve_arguments  # optional: the server extra
    except ImportError:
        # Without the server extra, `serve` takes any arguments and says what to install.
        serve.description = f"{serve.description} Needs the server extra: {_SERVER_EXTRA}"
        serve.set_defaults(func=_no_server)
    else:
        add_serve_arguments(serve)
        serve.set_defaults(func=_serve)

    token_help = "bearer token (env WEIGHTSERVE_TOKEN)"
    retry_env = "WEIGHTSERVE_RETRY_SECONDS"
    retry_help = (
        "how long to keep trying a busy, restarting or unreachable server, with jittered "
        f"backoff; 0: never (env {retry_env}; default: {COMMAND_START_SECONDS:g} s for a server "
        "that refuses the first connection, 60 s for an outage after it answered)"
    )
    retry_default = os.environ.get(retry_env) or None  # a string: argparse parses it too
    revision_help = (
        "the model's revision: a commit (40 hex digits, or a prefix of at least 12) or a ref "
        "(main); the same as MODEL@REVISION in the URL"
    )

    def server_flags(command: argparse.ArgumentParser) -> None:  # every command with a server
        command.add_argument("--token", default=None, help=token_help)
        command.add_argument(
            "--retry-seconds", type=_retry_seconds, default=retry_default, help=retry_help
        )

    def model_command(
        name: str, run: Callable[[argparse.Namespace], int], help: str, description: str
    ) -> argparse.ArgumentParser:
        """A command on one model, named by its URL first; ``run`` runs it."""
        command = sub.add_parser(name, help=help, description=description)
        command.add_argument("url", help="model URL")
        command.set_defaults(func=run)
        return command

    def progress_flag(command: argparse.ArgumentParser) -> None:  # commands that draw one
        command.add_argument("--quiet", action="store_true", help="no progress bar")

    ls = sub.add_parser(
        "ls",
        help="list a server's models, or one model's tensors",
        description="URL: http://HOST:PORT or grpc://HOST:PORT lists models; "
        "http://HOST:PORT/v1/models/MODEL or grpc://HOST:PORT/MODEL lists tensors.",
    )
    ls.add_argument("url")
    ls.add_argument("--prefix", default="", help="only tensors whose name starts so")
    ls.add_argument("--revision", default=None, help=revision_help)
    server_flags(ls)
    ls.set_defaults(func=_ls)

    pull = model_command(
        "pull",
        _pull,
        help="download a model's original files (or its tensors as one safetensors file)",
        description="Write the model's files (weights, index, config, tokenizer...) into OUT, "
        "byte-identical and verified against the server's digests, with a progress bar. An "
        "interrupted pull goes on where it stopped when run again. --to safetensors instead "
        "writes its tensors (or a prefix of them) into OUT/model.safetensors.",
    )
    pull.add_argument(
        "--out", default=None, help="output directory (default: the model's last path part)"
    )
    pull.add_argument(
        "--force", action="store_true", help="overwrite files in OUT that differ from the model's"
    )
    pull.add_argument(
        "--to",
        choices=["safetensors"],
        default=None,
        help="convert: the tensors as one safetensors file, the source's metadata kept "
        "(safetensors and PyTorch models; GGUF is refused)",
    )
    pull.add_argument("--prefix", default="", help="with --to: only tensors whose name starts so")
    pull.add_argument(
        "--since",
        default=None,
        metavar="R",
        help="OUT holds revision R's files (an earlier pull): update it in place, patching "
        "changed safetensors files from the server's delta, fetching other changed files "
        "whole and removing files the revision no longer has",
    )
    pull.add_argument("--revision", default=None, help=revision_help)
    server_flags(pull)
    pull.add_argument(
        "--parallel",
        type=positive_int,
        default=None,
        help="with --to: concurrent streams (default: one per four cores, 2 to 4; "
        "WEIGHTSERVE_PARALLEL_STREAMS)",
    )
    pull.add_argument(
        "--verify",
        type=_verify,
        default=os.environ.get("WEIGHTSERVE_VERIFY") or "full",
        help="with --to: which chunk digests to check, full, sample (each tensor's first "
        "chunk and one in eight of the others) or none (env WEIGHTSERVE_VERIFY; default "
        "full); a plain pull checks every file against its digest",
    )
    progress_flag(pull)

    publish = model_command(
        "publish",
        _publish,
        help="publish a directory of checkpoint files as a new revision of a model",
        description="Uploads every file below DIR as it is (checkpoints, config, tokenizer) "
        "and makes it the model's main revision once the server has checked it; prints the "
        "new commit. The model is created if new. URL: http://HOST:PORT/v1/models/MODEL.",
    )
    publish.add_argument("dir", type=Path, help="the directory to publish")
    publish.add_argument(
        "--base", default=None, help="a revision whose files this one keeps where DIR has none"
    )
    publish.add_argument("--message", "-m", default="", help="what changed")
    server_flags(publish)
    progress_flag(publish)

    watch = model_command(
        "watch",
        _watch,
        help="print each new revision of a model as it is published",
        description="One line per revision that becomes the model's main (commit, time, "
        "bytes, message), as the server announces it; reconnects through restarts. "
        "URL: http://HOST:PORT/v1/models/MODEL.",
    )
    watch.add_argument("--since", default=None, help="first print every revision after COMMIT")
    watch.add_argument(
        "--timeout", type=float, default=None, help="stop after this many seconds (default: never)"
    )
    server_flags(watch)
    follow = model_command(
        "follow-vllm",
        _follow_vllm,
        help="keep a running vLLM server on a model's main as revisions are published",
        description="Brings the vLLM server at --engine to the model's main now, then to each "
        "revision published, through vLLM's weight-update routes and the weightserve "
        "weight-transfer backend (the server runs with VLLM_SERVER_DEV_MODE=1, "
        "--load-format weightserve and --weight-transfer-config "
        '\'{"backend": "weightserve"}\'); prints each commit applied. '
        "URL: http://HOST:PORT/v1/models/MODEL (docs/vllm.md).",
    )
    follow.add_argument("--engine", required=True, help="the vLLM server: http://HOST:PORT")
    follow.add_argument(
        "--timeout", type=float, default=None, help="stop after this many seconds (default: never)"
    )
    server_flags(follow)
    add_cache_parser(sub, _CommandParser, token_help, (_retry_seconds, retry_default, retry_help))
    sub.add_parser(
        "max",
        add_help=False,  # `weightserve max --help` is MAX's help
        help="run MAX's command line (max generate, max serve ...) on a model URL",
        description="weightserve max ARGS...: MAX's `max ARGS...`, where --model-path may be "
        "http://HOST:PORT/v1/models/MODEL or grpc://HOST:PORT/MODEL; the weights stay on the "
        f"server (needs MAX: {install_hint('max', 'max[serve]')}).",
    )
    return parser


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("weightserve")
    except PackageNotFoundError:  # run from a tree that was never installed
        return "(version unknown: not installed)"


def reach_server(args: argparse.Namespace) -> None:
    """Wait for the server of ``args.url`` as ``--retry-seconds`` says (by default a short
    while): called by each command once its arguments are checked, before it talks to it."""
    from weightserve.client._retry import wait_for_server
    from weightserve.client.wire.routes import parse_url

    wait_for_server(parse_url(args.url)[0], args.retry_seconds)


def _no_server(args: argparse.Namespace) -> int:
    print(f"weightserve serve needs the server extra: {_SERVER_EXTRA}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from weightserve.service.cli import run_serve

    return run_serve(args)


def _ls(args: argparse.Namespace) -> int:
    from weightserve.client._client import Client
    from weightserve.client.wire.routes import parse_url

    _, model_id = parse_url(args.url)
    if model_id is None and args.revision is not None:
        args.command_parser.error("--revision names a revision of one model: give a model URL")
    reach_server(args)
    with Client(args.url, token=args.token, retry_seconds=args.retry_seconds) as client:
        if model_id is None:
            models, problems = client.list_models()
            # A node cache tells each model's state (remote, filling, cached); a server's own
            # root has nothing to tell, and its listing keeps the columns it always had.
            with_state = any(m.state != "local" for m in models)
            state_head = f"{'STATE':8} " if with_state else ""
            print(f"{'MODEL':40} {'FORMAT':12} {'TENSORS':>8} {'SIZE':>10}  {state_head}REVISION")
            for m in models:
                state = f"{m.state:8} " if with_state else ""
                print(
                    f"{m.id:40} {m.format or '-':12} {m.tensor_count:>8} "
                    f"{_size(m.total_bytes):>10}  {state}{m.revision}"
                )
            for p in problems:
                print(f"refused {p.model}: {p.reason}")
            return 0
        model = client.model(model_id, revision=args.revision)
        info = model.info
        commit = f"  commit {info.commit}" if info.commit else ""
        print(
            f"{info.id}  {info.format}  revision {info.revision}  "
            f"{len(info.tensors)} tensors  {_size(info.total_bytes)}{commit}"
        )
        for name in model.names(args.prefix):
            t = info.tensors[name]
            kind = f"{t.dtype}" + (f" ({t.encoding} {list(t.logical_shape)})" if t.encoding else "")
            print(f"{name:60} {kind:24} {str(list(t.shape)):20} {_size(t.nbytes):>10}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from weightserve.client._client import Client, FetchOptions
    from weightserve.client.wire.routes import parse_url, split_revision

    _, model_id = parse_url(args.url)
    if model_id is None:
        print(
            "weightserve pull: give a model URL, e.g. http://HOST:PORT/v1/models/MODEL",
            file=sys.stderr,
        )
        return 2
    if args.since is not None and args.to is not None:
        args.command_parser.error("--since updates pulled files: it does not go with --to")
    if args.prefix and args.to is None:
        args.command_parser.error(
            "--prefix selects tensors: it needs --to safetensors (a plain pull writes files)"
        )
    # The default directory is named by the model, not by the revision asked for.
    name = split_revision(model_id)[0].rstrip("/").split("/")[-1]
    out_dir = Path(args.out) if args.out else Path(name)
    reach_server(args)
    with Client(args.url, token=args.token, retry_seconds=args.retry_seconds) as client:
        options = FetchOptions(verify=args.verify)
        if args.parallel is not None:
            options = replace(options, parallel=args.parallel)
        model = client.model(model_id, options, revision=args.revision)
        if args.to == "safetensors":
            return _pull_converted(args, model, out_dir)
        if args.since is not None:
            return _pull_since(args, model, out_dir)
        from weightserve.client._download import FilePull

        pull = FilePull(model, out_dir, force=args.force).plan()
        try:
            with _progress(args, model_id, pull.total, pull.already) as bar:
                received, show_wait, replanned = bar
                pull.run(on_bytes=received, on_wait=show_wait, on_plan=replanned)
        except KeyboardInterrupt:
            print(
                "weightserve pull: interrupted; run the same command again to go on where it "
                "stopped",
                file=sys.stderr,
            )
            return 130
    print(out_dir)
    return 0


def _publish(args: argparse.Namespace) -> int:
    from weightserve.client._client import Client
    from weightserve.client._publish import publish_directory
    from weightserve.client.wire.routes import parse_url

    _, model_id = parse_url(args.url)
    if model_id is None:
        return args.command_parser.error("give a model URL, e.g. http://HOST:PORT/v1/models/MODEL")
    if not args.dir.is_dir():
        args.command_parser.error(f"{args.dir} is not a directory")
    total = sum(p.stat().st_size for p in args.dir.rglob("*") if p.is_file())
    reach_server(args)
    with (
        Client(args.url, token=args.token, retry_seconds=args.retry_seconds) as client,
        _progress(args, model_id, total) as (sent, _, _),
    ):
        revision = publish_directory(
            client.transport,
            model_id,
            args.dir,
            base=args.base,
            message=args.message,
            on_bytes=sent,
        )
    if revision.unchanged:
        print(
            f"unchanged: {args.dir} holds the same bytes as main ({revision.commit}); nothing "
            "was published" + (" and the message was not recorded" if args.message else ""),
            file=sys.stderr,
        )
    print(revision.commit)
    return 0


def _watch(args: argparse.Namespace) -> int:
    import time

    from weightserve.client._client import Client
    from weightserve.client._publish import watch
    from weightserve.client.wire.routes import parse_url

    _, model_id = parse_url(args.url)
    if model_id is None:
        return args.command_parser.error("give a model URL, e.g. http://HOST:PORT/v1/models/MODEL")
    reach_server(args)
    with Client(args.url, token=args.token, retry_seconds=args.retry_seconds) as client:
        for rev in watch(client.transport, model_id, args.since, args.timeout):
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rev.created))
            print(f"{rev.commit}  {when}  {_size(rev.bytes):>10}  {rev.message}", flush=True)
    return 0


def _follow_vllm(args: argparse.Namespace) -> int:
    from weightserve.client.vllm.follow import follow

    reach_server(args)
    for commit in follow(args.engine, args.url, token=args.token, timeout=args.timeout):
        print(commit, flush=True)
    return 0


def _pull_since(args: argparse.Namespace, model: Any, out_dir: Path) -> int:
    from weightserve.client._pull_since import PullSince

    pull = PullSince(model, out_dir, args.since)
    try:
        with _progress(args, model.id, 0) as (received, show_wait, replanned):
            pull.plan(received)
            # At most what a plain pull would move; the bar counts what travels.
            replanned(pull.changed_bytes, pull.report.wire_bytes)
            pull.run(received, show_wait)
            replanned(pull.report.wire_bytes, pull.report.wire_bytes)
    except KeyboardInterrupt:
        print(
            "weightserve pull: interrupted; run the same command again: the files already "
            "updated are kept",
            file=sys.stderr,
        )
        return 130
    r = pull.report
    print(
        f"weightserve pull: {r.kept} files kept, {r.patched} patched, {r.whole} fetched whole, "
        f"{r.removed} removed; {_size(r.wire_bytes)} travelled for {_size(r.model_bytes)} "
        "of files",
        file=sys.stderr,
    )
    print(out_dir)
    return 0


def _pull_converted(args: argparse.Namespace, model: Any, out_dir: Path) -> int:
    from weightserve.client._pull import pull_to_safetensors, source_metadata

    source_metadata(model)  # a format that does not convert fails before anything else
    names = model.names(args.prefix)
    if not names:
        print(
            f"weightserve pull: model {model.id!r} has no tensor whose name starts with "
            f"{args.prefix!r}",
            file=sys.stderr,
        )
        return 1
    total = sum(model.tensors[n].nbytes for n in names)
    with _progress(args, model.id, total) as (received, show_wait, _):
        path = pull_to_safetensors(
            model,
            out_dir / "model.safetensors",
            args.prefix,
            on_bytes=received,
            on_wait=show_wait,
            force=args.force,
        )
    print(path)
    return 0


@contextlib.contextmanager
def _progress(
    args: argparse.Namespace, what: str, total: int, initial: int = 0
) -> Iterator[
    tuple[Callable[[int], None], Callable[[str, float], None], Callable[[int, int], None]]
]:
    """A byte progress bar on stderr (none with --quiet): ``(on_bytes, on_wait, on_plan)``;
    ``on_plan(total, done)`` sets both anew (a pull that follows a model changed mid-way)."""
    from tqdm import tqdm

    with tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=what,
        disable=args.quiet or None,
        file=sys.stderr,
    ) as bar:

        def show_wait(reason: str, seconds: float) -> None:
            bar.set_postfix_str(f"{reason}, retrying in {seconds:.1f} s")

        def received(n: int) -> None:
            if getattr(bar, "postfix", None):  # data flows again: the wait is over
                bar.set_postfix_str("", refresh=False)
            bar.update(n)

        def replanned(new_total: int, done: int) -> None:
            bar.total, bar.n = new_total, done
            bar.refresh()

        yield received, show_wait, replanned


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["max"]:  # every later argument is MAX's, --help included
        from weightserve.client.max.command import run_max

        try:
            return run_max(argv[1:])
        except WeightserveError as e:
            print(f"weightserve max: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.func is not _no_server:  # `serve --demo` without the server extra
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("ls", "pull", "publish", "watch", "follow-vllm"):
        from weightserve.client.wire.routes import parse_url

        try:
            parse_url(args.url)
        except ValueError as e:  # a malformed URL is a usage error, not a traceback
            args.command_parser.error(str(e))
    try:
        return int(args.func(args) or 0)
    except WeightserveError as e:
        hint = f" ({TOKEN_HINT_CLI})" if isinstance(e, Unauthenticated) else ""
        print(f"weightserve {args.command}: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

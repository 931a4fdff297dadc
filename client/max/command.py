"""``weightserve max ARGS...``: MAX's own command line (``max generate``, ``max serve``, the
same flags) where ``--model-path`` may be a weightserve model URL, whose weights MAX then
loads from the server (client/max/pipelines.py) with none of them on this machine's disk.

MAX runs in a child ``python -m weightserve.client.max.command``: the model worker ``max
serve`` spawns imports this module again by name, which installs the same hook there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from weightserve.client._extras import install_hint
from weightserve.client.wire.routes import is_url, parse_url

__all__ = ["run_max"]

# MAX 26.7's spellings of the option that names the model (``--model`` is an alias).
MODEL_FLAGS = ("--model-path", "--model")
MAX_EXTRAS = install_hint("max", "max[serve]")
# Where the side files of URL models go, kept between runs (default: a temporary directory
# removed when MAX exits).
MODELS_DIR_ENV = "WEIGHTSERVE_MAX_DIR"


def model_urls(argv: list[str]) -> dict[int, str]:
    """Position in ``argv`` -> model URL, for each model flag whose value is a URL."""
    found = {}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in MODEL_FLAGS:
            continue
        if eq and is_url(value):
            found[i] = value
        elif not eq and i + 1 < len(argv) and is_url(argv[i + 1]):
            found[i + 1] = argv[i + 1]
    return found


def run_max(argv: list[str]) -> int:
    """Run ``max ARGV`` with each model URL replaced by a directory standing for it."""
    if importlib.util.find_spec("max") is None:
        print(f"weightserve max needs MAX: {MAX_EXTRAS}", file=sys.stderr)
        return 2
    from weightserve.client.max.pipelines import MODELS_ENV, IncompleteModel, prepare_model_dir

    urls = model_urls(argv)
    kept = os.environ.get(MODELS_DIR_ENV)
    work = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="weightserve-max-"))
    try:
        args, served = list(argv), {}
        for i, url in urls.items():
            if parse_url(url)[1] is None:
                print(
                    f"weightserve max: {url} names a server, not a model: use "
                    "http://HOST:PORT/v1/models/MODEL or grpc://HOST:PORT/MODEL",
                    file=sys.stderr,
                )
                return 2
            try:
                model = prepare_model_dir(
                    url, work / re.sub(r"[^\w.@-]+", "-", url.split("://")[1])
                )
            except IncompleteModel as e:
                print(f"weightserve max: {e}", file=sys.stderr)
                return 2
            served.update(model.to_environment())
            args[i] = (
                args[i].replace(url, str(model.directory))
                if "=" in args[i]
                else str(model.directory)
            )
        if args[:1] == ["serve"] and len(urls) == 1 and not _has_flag(args, "--served-model-name"):
            # Clients name the model as the URL does, not by the directory standing for it.
            args += ["--served-model-name", str(parse_url(next(iter(urls.values())))[1])]
        # MAX points the processes it spawns (model worker, metrics) at the python3 on PATH:
        # this interpreter's, so they import this environment's packages (weightserve too).
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = {**os.environ, MODELS_ENV: json.dumps(served), "PATH": path}
        return _run_child([sys.executable, "-m", __name__, *args], env)
    finally:
        if not kept:
            shutil.rmtree(work, ignore_errors=True)


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in argv)


def _run_child(command: list[str], env: dict[str, str]) -> int:
    """Run MAX and wait for it; a SIGTERM here is passed on (Ctrl-C reaches both)."""
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: Any) -> None:
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                continue  # the child got the same Ctrl-C and ends on its own
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main() -> None:
    from weightserve.client.max.pipelines import install_hook

    try:
        install_hook()
    except ImportError as e:  # MAX without its serving stack
        sys.exit(f"weightserve max: MAX's pipelines need {e.name or e}: {MAX_EXTRAS}")
    if __name__ == "__main__":
        from max._entrypoints.pipelines import main

        sys.argv = ["max", *sys.argv[1:]]
        # Click would name the program after this module (python -m ...): name the command.
        main(prog_name="weightserve max")


# Run as MAX's process (``__main__``) or imported again by name in a process MAX spawned
# (``__mp_main__``): either way the hook goes in before MAX builds a pipeline.
if __name__ in ("__main__", "__mp_main__"):
    _main()

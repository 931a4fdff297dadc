"""The model browser at ``/``, driven in headless Chromium (Debian's ``chromium`` package,
through Playwright's Python package: its own browser download is not used).

Everything the page shows is checked against the JSON API of the same server; every request
the page makes must go to that server, and the console must stay free of errors.
Screenshots land in pytest's ``tmp_path``.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.security import FULL_TOKEN, TEAM_A_TOKEN, write_tokens
from weightserve.service.server import ServerConfig, WeightServer

playwright_sync = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium; .ci/run does)",
        allow_module_level=True,
    )

WAIT_MS = 10_000
MANY_TENSORS = 3000


def api(base: str, path: str, token: str | None = None) -> Any:
    request = urllib.request.Request(base + path)
    if token:
        request.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=20) as response:
        return json.loads(response.read())


def quoted(text: str) -> str:
    return urllib.parse.quote(text, safe="/")


@dataclass
class Watched:
    """A page and what it did: every request URL, and console errors or uncaught exceptions."""

    page: Any
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def assert_clean(self, origin: str) -> None:
        """No request left ``origin`` (a data: URL goes nowhere), nothing logged as an error."""
        elsewhere = [
            url
            for url in self.requests
            if not url.startswith(origin + "/") and urllib.parse.urlsplit(url).scheme != "data"
        ]
        assert not elsewhere, f"the page fetched from another origin: {elsewhere}"
        assert not self.errors, f"console errors: {self.errors}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def watched(browser: Any) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1366, "height": 860})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    seen = Watched(page)
    page.on("request", lambda r: seen.requests.append(r.url))
    page.on("console", lambda m: seen.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: seen.errors.append(f"uncaught: {e}"))
    try:
        yield seen
    finally:
        context.close()


def histogram_counts(page: Any) -> list[int]:
    page.wait_for_selector("#histogram rect.bar")
    return [
        int(c)
        for c in page.eval_on_selector_all(
            "#histogram rect.bar", "bars => bars.map(b => b.dataset.count)"
        )
    ]


def unfold(page: Any, prefix: str) -> None:
    page.click(f'details[data-prefix="{prefix}"] > summary')
    page.wait_for_selector(f'details[data-prefix="{prefix}"][open] > .children > *')


def test_browse_models_tree_and_histograms(
    server: WeightServer, watched: Watched, tmp_path: Path
) -> None:
    base, page = server.http_url, watched.page
    listing = api(base, "/v1/models")
    page.goto(base + "/")
    page.wait_for_selector("#models tbody tr")
    page.screenshot(path=str(tmp_path / "models.png"))

    # The list: every model the API lists, with its tensor count; typing filters it.
    rows = page.eval_on_selector_all(
        "#models tbody tr", "rows => rows.map(r => [r.dataset.model, r.cells[3].textContent])"
    )
    assert rows == [[m["id"], str(m["tensor_count"])] for m in listing["models"]]
    page.fill("#model-filter", "gguf")
    shown = page.eval_on_selector_all("#models tbody tr", "rows => rows.map(r => r.dataset.model)")
    assert shown == [m["id"] for m in listing["models"] if "gguf" in m["id"] + m["format"]]
    page.fill("#model-filter", "")

    # A sharded safetensors model: unfold model. > layers. > 1., select a tensor.
    info = api(base, "/v1/models/org/sharded")
    page.click('tr[data-model="org/sharded"] a')
    page.wait_for_selector("#model-view:not([hidden])")
    assert page.text_content("#model-tensor-count") == str(info["tensor_count"])
    assert page.text_content("#model-revision") == info["revision"]
    for prefix in ("model.", "model.layers.", "model.layers.1."):
        unfold(page, prefix)
    in_group = page.eval_on_selector_all(
        'details[data-prefix="model.layers.1."] > .children > .tensor',
        "rows => rows.map(r => r.dataset.name)",
    )
    assert sorted(in_group) == sorted(
        t["name"] for t in info["tensors"] if t["name"].startswith("model.layers.1.")
    )
    assert page.input_value("#snippet-prefix") == "model.layers.1."
    assert f"{base}/v1/models/org/sharded" in page.text_content("#snippets")

    name = "model.layers.1.attn.weight"
    tensor = next(t for t in info["tensors"] if t["name"] == name)
    page.click(f'.tensor[data-name="{name}"]')
    counts = histogram_counts(page)
    stats = api(base, f"/v1/models/org/sharded/-/stats/{quoted(name)}")
    assert counts == stats["histogram"]["counts"] and sum(counts) == stats["finite"]
    assert page.text_content("#tensor-dtype") == tensor["dtype"] == "float32"
    assert page.text_content("#tensor-shape") == "[" + ", ".join(map(str, tensor["shape"])) + "]"
    assert page.text_content("#stats-nan") == str(stats["nan_count"])
    page.screenshot(path=str(tmp_path / "sharded-tensor.png"), full_page=True)

    # A GGUF model: a quantized tensor's histogram is of its dequantized values.
    info = api(base, "/v1/models/tiny.gguf")
    page.click("a.back")
    page.click('tr[data-model="tiny.gguf"] a')
    page.wait_for_selector("#model-title:text-is('tiny.gguf')")
    assert page.text_content("#model-tensor-count") == str(len(info["tensors"]))
    unfold(page, "blk.")
    unfold(page, "blk.0.")
    name = "blk.0.ffn_down.weight"
    tensor = next(t for t in info["tensors"] if t["name"] == name)
    page.click(f'.tensor[data-name="{name}"]')
    counts = histogram_counts(page)
    stats = api(base, f"/v1/models/tiny.gguf/-/stats/{quoted(name)}")
    assert stats["values"] == "dequantized" and stats["sampled"] == stats["count"] == 64 * 32
    assert counts == stats["histogram"]["counts"]
    assert page.text_content("#tensor-encoding") == tensor["encoding"] == "Q4_0"
    assert page.text_content("#tensor-shape") == "[64, 32]"
    # Metadata (GGUF key-values) is shown; the bytes chart has one bar per layer or module.
    assert "general.architecture" in page.text_content("#metadata")
    assert page.locator("#bytes-svg rect.bar").count() >= 3
    page.screenshot(path=str(tmp_path / "gguf-tensor.png"), full_page=True)

    watched.assert_clean(base)


# ----------------------------------------------------------------------------- a token server


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    """Models of two teams, and one with thousands of tensors, behind bearer tokens."""
    base = tmp_path_factory.mktemp("browser")
    root = base / "root"
    rng = np.random.default_rng(0)
    for model_id in ("team-a/x", "team-b/z"):
        (root / model_id).mkdir(parents=True)
        save_file(
            {"w": rng.standard_normal((4, 8)).astype(np.float32)},
            root / model_id / "model.safetensors",
        )
    many = {
        f"model.layers.{i // 10}.mlp.w{i % 10}.weight": np.full(4, i, np.float16)
        for i in range(MANY_TENSORS)
    }
    (root / "many").mkdir()
    save_file(many, root / "many" / "model.safetensors")
    tokens = base / "tokens"
    write_tokens(tokens, f"{FULL_TOKEN}\n{TEAM_A_TOKEN}  team-a/*\n")
    srv = WeightServer(
        ServerConfig(
            str(root),
            http_port=0,
            grpc_port=0,
            flight_port=0,
            rescan_seconds=0,
            token_file=str(tokens),
        )
    ).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


def test_token_prompt_then_only_allowed_models(
    token_server: WeightServer, watched: Watched, tmp_path: Path
) -> None:
    base, page = token_server.http_url, watched.page
    page.goto(base + "/")
    page.wait_for_selector("#auth:not([hidden])")
    assert page.is_hidden("#models-view")
    page.screenshot(path=str(tmp_path / "token-prompt.png"))

    page.fill("#token-input", TEAM_A_TOKEN)
    page.press("#token-input", "Enter")  # the keyboard is enough
    page.wait_for_selector("#models tbody tr")
    shown = page.eval_on_selector_all("#models tbody tr", "rows => rows.map(r => r.dataset.model)")
    assert (
        shown == [m["id"] for m in api(base, "/v1/models", TEAM_A_TOKEN)["models"]] == ["team-a/x"]
    )
    assert page.evaluate("sessionStorage.getItem('weightserve.token')") == TEAM_A_TOKEN

    # A model the token may not read: the page says so, it shows nothing of it.
    page.goto(base + "/#m=team-b%2Fz")
    page.wait_for_selector("#status.error")
    assert "PermissionDenied" in page.text_content("#status")
    assert page.is_hidden("#model-view")

    # The 401 that asked for the token and the refused model are the browser's own
    # "Failed to load resource" lines; nothing else may be logged.
    watched.errors[:] = [
        e for e in watched.errors if "status of 401" not in e and "status of 403" not in e
    ]
    watched.assert_clean(base)


def test_thousands_of_tensors_paint_fast(token_server: WeightServer, watched: Watched) -> None:
    base, page = token_server.http_url, watched.page
    page.goto(base + "/")
    page.evaluate(f"sessionStorage.setItem('weightserve.token', {json.dumps(FULL_TOKEN)})")
    started = time.perf_counter()
    page.goto(base + "/#m=many")
    page.wait_for_selector('details[data-prefix="model.layers."]')
    took = time.perf_counter() - started
    assert took < 2.0, f"the tree of {MANY_TENSORS} tensors took {took:.2f} s to show"
    assert page.text_content("#model-tensor-count") == str(MANY_TENSORS)
    # Folded groups are not in the page until opened: 300 layers, one row each.
    assert page.locator(".tensor").count() == 0
    unfold(page, "model.layers.")
    assert page.locator('details[data-prefix^="model.layers."]').count() == 1 + MANY_TENSORS // 10
    page.fill("#tensor-filter", "w7.weight")
    page.wait_for_selector("#tree > p")
    assert page.text_content("#tree > p") == f"{MANY_TENSORS // 10} matching tensors"
    watched.errors[:] = [e for e in watched.errors if "status of 401" not in e]
    watched.assert_clean(base)

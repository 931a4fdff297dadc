"""Refusals and misses on the Hub routes, as huggingface_hub itself reports them.

A real server with a token file; the real ``huggingface_hub`` in a child process (it reads
``HF_ENDPOINT`` once, at import) with ``HF_ENDPOINT`` at the server on loopback. Each error
must reach the user as the Hub's own exception with the server's reason, never as the
"check your connection" huggingface_hub gives for a 4xx it cannot classify.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support import fixtures_safetensors
from tests.support.environment import child_environment
from tests.support.paths import REPO
from weightserve.service.server import ServerConfig, WeightServer

GRANTED = "org/a"
REFUSED = "org/b"
TOKEN_A = "hub-errors-token-a-0123456789"  # may read org/a only
TOKEN_ALL = "hub-errors-token-all-9876543210"  # may read every model

# Run in the child: every case's outcome as [exception class, its MRO names, status, message].
_CLIENT = """
import json, sys
from huggingface_hub import HfApi, hf_hub_download, snapshot_download

token, token_all, granted, refused, cache = sys.argv[1:6]

def outcome(call):
    try:
        call()
        return ["ok", [], None, ""]
    except Exception as e:
        response = getattr(e, "response", None)
        status = getattr(response, "status_code", None)
        return [type(e).__name__, [c.__name__ for c in type(e).__mro__], status, str(e)]

# A cold cache per case: hf_hub_download answers a failed HEAD from a file it already has.
file = lambda repo, tok, name="config.json", **kw: lambda: hf_hub_download(
    repo, name, token=tok, cache_dir=f"{cache}/{repo}-{tok}-{name}", **kw)
print(json.dumps({
    "granted": outcome(file(granted, token)),
    "refused_file": outcome(file(refused, token)),
    "refused_snapshot": outcome(lambda: snapshot_download(refused, token=token, cache_dir=cache)),
    "refused_info": outcome(lambda: HfApi().model_info(refused, token=token)),
    "no_token_file": outcome(file(granted, False)),
    "no_token_snapshot": outcome(lambda: snapshot_download(granted, token=False, cache_dir=cache + "/cold")),
    "bad_token_file": outcome(file(granted, "not-a-token-at-all")),
    "missing_file": outcome(file(granted, token, "absent.json")),
    "missing_revision": outcome(file(granted, token, revision="v9")),
    # A limited token is refused an absent repo as any other (no probing for names).
    "missing_repo": outcome(file("org/absent", token_all)),
}))
"""


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    root = tmp_path_factory.mktemp("hub-errors-root")
    for repo in (GRANTED, REFUSED):
        (root / repo).mkdir(parents=True)
        fixtures_safetensors.write_mixed_dtypes(root / repo, "model.safetensors")
        (root / repo / "config.json").write_text('{"model_type": "bert"}\n')
    tokens = tmp_path_factory.mktemp("hub-errors-tokens") / "tokens"
    tokens.write_text(f"{TOKEN_A} {GRANTED}\n{TOKEN_ALL}\n")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, token_file=str(tokens)
    )
    srv = WeightServer(config).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def outcomes(hub_server: WeightServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    home = tmp_path_factory.mktemp("hub-errors-home")
    env = child_environment()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        env.pop(key, None)  # offline mode would answer every case from the (empty) cache
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{hub_server.http_port}",
        HF_HOME=str(home / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT, TOKEN_A, TOKEN_ALL, GRANTED, REFUSED, str(home / "cache")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_granted_token_downloads(outcomes: dict[str, list]) -> None:
    assert outcomes["granted"][0] == "ok", outcomes["granted"]


@pytest.mark.parametrize("case", ["refused_file", "refused_snapshot", "refused_info"])
def test_a_token_not_granted_the_model_is_a_permission_error(
    outcomes: dict[str, list], case: str
) -> None:
    """403 with X-Error-Code GatedRepo: GatedRepoError with the server's reason, on the HEAD
    of hf_hub_download (headers only) as on the API's GET."""
    name, mro, status, message = outcomes[case]
    assert (name, status) == ("GatedRepoError", 403), outcomes[case]
    assert f"may not read model {REFUSED!r}" in message
    assert "check your connection" not in message


@pytest.mark.parametrize("case", ["no_token_file", "no_token_snapshot"])
def test_a_missing_token_is_the_401_error(outcomes: dict[str, list], case: str) -> None:
    name, mro, status, message = outcomes[case]
    assert "HfHubHTTPError" in mro and "LocalEntryNotFoundError" not in mro, outcomes[case]
    assert status == 401
    assert "needs a bearer token" in message


def test_an_invalid_token_is_the_401_error(outcomes: dict[str, list]) -> None:
    name, mro, status, message = outcomes["bad_token_file"]
    assert "HfHubHTTPError" in mro and "LocalEntryNotFoundError" not in mro
    assert status == 401 and "Invalid credentials" in message


@pytest.mark.parametrize(
    ("case", "expected", "reason"),
    [
        ("missing_file", "RemoteEntryNotFoundError", "absent.json"),
        ("missing_revision", "RevisionNotFoundError", "v9"),
        ("missing_repo", "RepositoryNotFoundError", "org/absent"),
    ],
)
def test_misses_are_the_hubs_not_found_errors(
    outcomes: dict[str, list], case: str, expected: str, reason: str
) -> None:
    name, mro, status, message = outcomes[case]
    assert (name, status) == (expected, 404), outcomes[case]
    assert reason in message

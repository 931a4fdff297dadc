"""Run by tests/service/transports/test_hub_compat.py inside its own network namespace
(``unshare -n``): starts a weightserve on loopback, points ``HF_ENDPOINT`` at it and loads a
model the ways Hub users do (``snapshot_download``, ``hf_hub_download``, transformers,
sentence-transformers), printing what it found as one JSON line for the test to check.

    python -m tests.support._hub_client ROOT REPO_ID TOKEN_FILE TOKEN
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

SENTENCES = ["weights served over the wire", "a Hub mirror on loopback", "ok"]


def main(root: str, repo_id: str, token_file: str, token: str) -> dict:
    from weightserve.service.server import ServerConfig, WeightServer

    server = WeightServer(
        ServerConfig(root, http_port=0, grpc_port=0, flight_port=None, token_file=token_file)
    ).start()
    try:
        # Set before huggingface_hub is imported: it reads them once, at import.
        os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{server.http_port}"
        os.environ["HF_TOKEN"] = token
        return load_everything(Path(root) / repo_id, repo_id)
    finally:
        server.stop(grace=1.0)


def load_everything(local: Path, repo_id: str) -> dict:
    import numpy as np
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RevisionNotFoundError
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    snapshot = Path(snapshot_download(repo_id))
    downloaded = {
        p.relative_to(snapshot).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    }
    missing_file = revision_unknown = ""
    try:
        hf_hub_download(repo_id, "no-such-file.json")
    except RemoteEntryNotFoundError as e:
        missing_file = type(e).__name__
    try:
        hf_hub_download(repo_id, "config.json", revision="v9-not-served")
    except RevisionNotFoundError as e:
        revision_unknown = type(e).__name__

    mirrored = SentenceTransformer(repo_id).encode(SENTENCES)
    from_disk = SentenceTransformer(str(local)).encode(SENTENCES)

    def hidden_states(name: str) -> np.ndarray:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModel.from_pretrained(name)
        batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
        return model(**batch).last_hidden_state.detach().numpy()

    return {
        "snapshot_commit": snapshot.name,
        "downloaded": downloaded,
        "missing_file": missing_file,
        "revision_unknown": revision_unknown,
        "sentence_transformers_equal": bool(np.array_equal(mirrored, from_disk)),
        "embedding_shape": list(mirrored.shape),
        "transformers_equal": bool(
            np.array_equal(hidden_states(repo_id), hidden_states(str(local)))
        ),
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))

"""A real S3 server on loopback for tests: SeaweedFS, started by ``bench/s3.py`` (shared with
the cold fill benchmark): every port given explicitly and bound to 127.0.0.1, telemetry off,
static credentials, data in a temporary dir.

``s3_server`` (session fixture) starts it, creates a bucket and puts the credentials into this
process's environment (where pyarrow finds them, as it would in production). Importing this
module sets ``AWS_EC2_METADATA_DISABLED=true``: the AWS SDK must never probe the instance
metadata address from a test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.s3 import (
    ACCESS_KEY,
    BUCKET,
    SECRET_KEY,
    S3Server,
    free_ports,
    running_seaweedfs,
    weed_binary,
)

__all__ = [
    "ACCESS_KEY",
    "BUCKET",
    "SECRET_KEY",
    "S3Server",
    "free_ports",
    "running_seaweedfs",
    "s3_server_fixture",
    "weed_binary",
]


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A running SeaweedFS with a bucket, its credentials in the environment (and no
    profiles from the user's home), so ``pyarrow.fs`` URIs of it work as in production."""
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE",
            "AWS_PROFILE",
        )
    }
    workdir = tmp_path_factory.mktemp("seaweedfs")
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_CONFIG_FILE": str(workdir / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws-credentials"),
        }
    )
    for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(key, None)
    try:
        with running_seaweedfs(workdir) as server:
            yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

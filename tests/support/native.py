"""The optional C extensions (pyproject.toml's ext-modules): which compiler the install would
build them with."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig


def c_compiler() -> str | None:
    """The compiler the install would build extensions with, if it is on PATH."""
    command = sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(command)[0])


def printed_with_native_setting(code: str, setting: str | None) -> str:
    """What ``code`` prints in a fresh interpreter with ``WEIGHTSERVE_NATIVE`` set to
    ``setting`` (None: unset): the extensions' switch is read once at import."""
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSERVE_NATIVE"}
    if setting is not None:
        env["WEIGHTSERVE_NATIVE"] = setting
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()

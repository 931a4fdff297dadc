"""The gRPC contract: generated code is never stale, and the .proto documents every rpc and
every field (it is the spec of the wire)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

PROTOS = sorted((REPO / "protos").rglob("*.proto"))

RPC = re.compile(r"^\s*rpc\s+(\w+)\s*\(")
FIELD = re.compile(
    r"^\s*(?:(?:repeated|optional)\s+)?(?:map\s*<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+\s*(?:\[[^\]]*\])?\s*;"
)
BLOCK = re.compile(r"^\s*(message|service|enum|oneof)\s+(\w+)\s*\{")


def test_generated_code_is_fresh(child_env) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=child_env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stale" not in proc.stdout


def undocumented(text: str) -> list[str]:
    """Every rpc or field line neither preceded by a ``//`` comment line nor ending in one."""
    missing = []
    previous = ""
    scope: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if block := BLOCK.match(line):
            scope.append(block.group(2))
        kind = "rpc" if RPC.match(line) else "field" if scope and FIELD.match(line) else None
        if kind:
            name = (RPC.match(line) or FIELD.match(line)).group(1)  # type: ignore[union-attr]
            if not (previous.startswith("//") or "//" in line.partition(";")[2]):
                missing.append(f"line {number}: {kind} {'.'.join(scope)}.{name}")
        if stripped.endswith("}") and scope and not stripped.startswith("//"):
            scope.pop()
        if stripped:
            previous = stripped
    return missing


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_rpc_and_field_is_commented(proto: Path) -> None:
    text = proto.read_text()
    assert any(RPC.match(line) or FIELD.match(line) for line in text.splitlines())
    missing = undocumented(text)
    assert not missing, "undocumented in the wire spec:\n" + "\n".join(missing)


def test_comment_check_sees_what_it_should() -> None:
    """The parser itself: a commented and an uncommented field, a grouped one, an rpc."""
    sample = """
service S {
  // Documented above.
  rpc A(X) returns (Y);
  rpc B(X) returns (stream Y);
}
message X {
  string a = 1;  // trailing
  // above
  repeated int64 b = 2;
  map<string, string> c = 3;
  bytes d = 4 [deprecated = true];
}
"""
    assert undocumented(sample) == ["line 5: rpc S.B", "line 11: field X.c", "line 12: field X.d"]


def test_every_rpc_and_message_parsed() -> None:
    """The check covers the real service: all three rpcs and all fields of TensorRequest."""
    from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb

    text = "\n".join(p.read_text() for p in PROTOS)
    rpcs = {m.group(1) for line in text.splitlines() if (m := RPC.match(line))}
    assert rpcs == {m.name for m in pb.DESCRIPTOR.services_by_name["WeightService"].methods}
    fields = {m.group(1) for line in text.splitlines() if (m := FIELD.match(line))}
    for message in pb.DESCRIPTOR.message_types_by_name.values():
        assert {f.name for f in message.fields} <= fields, message.name

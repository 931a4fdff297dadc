"""The wire contract both sides import: the Arrow schema and IPC framing, the dtype table,
route and id rules, the error codec, the handoff frames and the generated gRPC stubs
(``weightserve.client.wire.proto``, which any gRPC or Flight client may import). Public to the
server and to other clients; documented in docs/protocol.md."""

"""The wire contract both sides import: the Arrow schema and IPC framing, the dtype table,
route and id rules, the handoff frames and the generated gRPC stubs. Public to the server;
documented in docs/protocol.md."""

"""A small answer (one tensor) leaves the server in one socket write: the client's first
receive holds its head and its whole body, on a kept-alive connection and on one the server
closes after the answer."""

from __future__ import annotations

import select
import socket

from tests.support._util import http_request


def _first_receive(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    poller = select.poll()  # not select(): a long test run's descriptors pass 1024
    poller.register(sock, select.POLLIN)
    assert poller.poll(10_000)
    return sock.recv(1 << 20)


def _whole(answer: bytes) -> bool:
    head, found, body = answer.partition(b"\r\n\r\n")
    lengths = [
        line.split(b":", 1)[1]
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    return bool(found) and len(lengths) == 1 and len(body) == int(lengths[0])


def test_a_small_answer_is_one_write(server) -> None:
    expected = http_request(server.http_port, "/v1/models/mixed/-/tensors/float32").body
    get = b"GET /v1/models/mixed/-/tensors/float32 HTTP/1.1\r\nHost: here\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(20):  # kept alive: every answer whole in its first receive
            answer = _first_receive(sock, get)
            assert answer.startswith(b"HTTP/1.1 200 ") and _whole(answer)
            assert answer.endswith(expected)
    closing = get.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        answer = _first_receive(sock, closing)
        assert _whole(answer) and answer.endswith(expected)
        assert b"connection: close" in answer.lower()
        assert sock.recv(1) == b""  # then closed, after the answer went out


def test_error_answers_are_unchanged(server) -> None:
    get = b"GET /v1/models/mixed/-/tensors/no.such HTTP/1.1\r\nHost: here\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        answer = _first_receive(sock, get)
        while not _whole(answer):
            answer += sock.recv(1 << 20)
        assert answer.startswith(b"HTTP/1.1 404 ") and b"TensorNotFound" in answer

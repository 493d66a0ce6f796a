"""render/front/listener_close.py on real loopback sockets: what close() does to a listener's
accept queue, and the close that serves the queue instead."""

import asyncio
import socket
import time

import pytest

from render.front.listener_close import take_queue

QUEUED = 3
REQUEST = b"GET / HTTP/1.1\r\n\r\n"
ANSWER = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    return sock


def queue_length(sock: socket.socket) -> int:
    """tcp_info's tcpi_unacked: a listener's accept backlog (what `ss` shows as Recv-Q)."""
    return int.from_bytes(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 28)[24:28], "little")


def connect_queued(sock: socket.socket, n: int = QUEUED) -> list[socket.socket]:
    """Clients whose handshake the kernel completed and who sent a request; nobody accepted them."""
    clients = [socket.create_connection(sock.getsockname(), timeout=5) for _ in range(n)]
    for c in clients:
        c.sendall(REQUEST)
    deadline = time.monotonic() + 5
    while queue_length(sock) < n:
        assert time.monotonic() < deadline, queue_length(sock)
        time.sleep(0.01)
    return clients


def test_closing_a_listener_resets_the_clients_in_its_accept_queue():
    """The kernel's behaviour the module exists for: a queued client reads a reset, not an answer."""
    sock = listener()
    clients = connect_queued(sock)
    sock.close()
    for c in clients:
        with c, pytest.raises(ConnectionResetError):
            c.recv(64)


class Answer(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(ANSWER)
        self.transport.close()


def test_the_queue_taken_before_the_close_is_served_and_later_clients_are_refused():
    sock = listener()
    clients = connect_queued(sock)
    address = sock.getsockname()

    async def close_serving_the_queue() -> int:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Answer, sock=sock)
        queued = take_queue(sock)
        server.close()
        for conn in queued:
            await loop.connect_accepted_socket(Answer, conn)
        await asyncio.sleep(0.2)
        return len(queued)

    assert asyncio.run(close_serving_the_queue()) == QUEUED
    for c in clients:
        with c:
            assert c.recv(64) == ANSWER
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5)


def test_an_empty_queue_is_nothing_to_take():
    with listener() as sock:
        assert take_queue(sock) == []

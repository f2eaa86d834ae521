"""The listening sockets of serve and the gate: connections accepted on them send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from batchpilot_runtime.server.listen import bind_socket


async def test_accepted_connections_have_nagle_off() -> None:
    # With Nagle on, an SSE chunk written behind unacknowledged headers waits ~40 ms for a delayed ACK.
    sock = bind_socket("127.0.0.1", 0)
    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connection, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(nodelay, 10) != 0
        writer.close()

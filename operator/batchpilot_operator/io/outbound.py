"""What every outbound HTTP call of the operator shares: URLs built from addresses, bodies read with a cap.

- :func:`base_url` puts an IPv6 literal in brackets (``http://[fd00::1]:8081``,
  RFC 3986); ``http://fd00::1:8081`` is not a URL, and httpx refuses it.
- :func:`read_capped` streams a response body and stops past ``max_bytes``, so
  that an answer that never ends, or a 100 MiB one, costs at most the cap in
  memory. The overall deadline of a call is the caller's (``asyncio.timeout``
  around the request and this read), because httpx's timeouts are per phase and
  a body dripped a byte at a time never trips them.
"""

from __future__ import annotations

import ipaddress

import httpx


def host_port(host: str, port: int) -> str:
    """``host:port`` for a URL's authority, with an IPv6 literal in brackets (a name or IPv4 as it is)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        is_ipv6 = ipaddress.ip_address(bare).version == 6
    except ValueError:  # a DNS name
        is_ipv6 = False
    return f"[{bare}]:{port}" if is_ipv6 else f"{host}:{port}"


def base_url(host: str, port: int, scheme: str = "http") -> str:
    """``scheme://host:port`` (no trailing slash) for an address or a name."""
    return f"{scheme}://{host_port(host, port)}"


class BodyTooLarge(Exception):
    """The answer's body is longer than the caller's cap; what was read so far is dropped."""

    def __init__(self, max_bytes: int, seen_bytes: int) -> None:
        super().__init__(f"answer body over the {format_bytes(max_bytes)} cap (stopped after {seen_bytes} bytes)")
        self.max_bytes = max_bytes
        self.seen_bytes = seen_bytes


def format_bytes(count: int) -> str:
    if count >= 1 << 20 and count % (1 << 20) == 0:
        return f"{count >> 20} MiB"
    if count >= 1 << 10 and count % (1 << 10) == 0:
        return f"{count >> 10} KiB"
    return f"{count} bytes"


async def read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    """The body of a streamed response (``client.send(..., stream=True)``); BodyTooLarge past ``max_bytes``.

    A declared ``Content-Length`` over the cap fails before any byte is read. The caller closes the response.
    """
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes, 0)
    chunks: list[bytes] = []
    seen = 0
    async for chunk in response.aiter_bytes():
        seen += len(chunk)
        if seen > max_bytes:
            raise BodyTooLarge(max_bytes, seen)
        chunks.append(chunk)
    return b"".join(chunks)

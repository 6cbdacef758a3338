"""The status phase's load client for ``shoal bench api``: one lean keep-alive HTTP/1.1
connection per simulated client."""

from __future__ import annotations

import asyncio

import httpx


class Connection:
    """One keep-alive HTTP/1.1 connection sending authenticated GETs: the status phase's
    client, a few lines of asyncio rather than an HTTP library, so that the load generator
    takes as little as it can of the CPUs it shares with the server (with httpx it took
    half as much CPU per request as the server). It reads the responses the API sends (a status
    line, headers with ``Content-Length``, a body); anything else is an error."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._head = b""

    @classmethod
    async def open(cls, url: str, token: str) -> Connection:
        address = httpx.URL(url)
        port = address.port or 80
        reader, writer = await asyncio.open_connection(address.host, port)
        connection = cls(reader, writer)
        connection._head = (
            f"Host: {address.host}:{port}\r\nAuthorization: Bearer {token}\r\n\r\n"
        ).encode()
        return connection

    async def get(self, path: str) -> int:
        """``GET path``: the response's status code, once its body has been read."""
        self._writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\n" + self._head)
        head = await self._reader.readuntil(b"\r\n\r\n")
        length = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise ConnectionError("a response without Content-Length")
        await self._reader.readexactly(length)
        return int(head[9:12])

    def close(self) -> None:
        self._writer.close()

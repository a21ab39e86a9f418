"""The client's side of one request on its ASGI connection: a disconnect watched (it cancels the request's
task), an error sent before the response started, the exception for a client gone before its body was
complete.
"""

from __future__ import annotations

import asyncio

from gateway.wire.errors import GatewayError
from gateway.wire.results import ResponseState


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def _watch_disconnect(receive, task: asyncio.Task, state: ResponseState, gone: list[bool]) -> None:  # noqa: ANN001
    """Cancel the request's task when the client goes away (this closes the upstream response)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not state.ended:
                gone.append(True)
                task.cancel()
            return


async def _send_error(send, err: GatewayError, extra_headers: list[tuple[bytes, bytes]]) -> None:  # noqa: ANN001
    body = err.body()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [*err.headers(), (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})

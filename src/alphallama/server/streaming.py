"""Noticing a client that went away, for streamed and whole responses alike.

A disconnect must cancel the generation at once so the next request can have the
engine. Starlette's StreamingResponse only watches for it on some ASGI versions (on
others it notices at the next failed write), so EventStream always listens, and
`until_disconnect` does the same while a whole (non-streamed) response is computed.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def sse(obj: dict | str) -> str:
    """One server-sent event carrying a JSON object (or a literal such as [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    # The body has been read already, so the next message can only be the disconnect
    # (the server also sends it once the response is complete).
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """text/event-stream whose producer is cancelled as soon as the client disconnects;
    `on_close` runs however the stream ends (a no-op when it ended normally)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def produce() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:   # the socket broke during a write: a disconnect too
                        pass
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(produce)
                tg.start_soon(watch)
        finally:
            self._on_close()


async def until_disconnect(request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T | None:
    """Await `work`; if the client disconnects first, call on_disconnect and keep awaiting
    `work` (which then ends promptly, e.g. with a Cancelled event). None if it went."""
    result: list[T] = []
    gone = False

    async with anyio.create_task_group() as tg:
        async def run() -> None:
            result.append(await work)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal gone
            await _wait_disconnect(request.receive)
            gone = True
            on_disconnect()

        tg.start_soon(run)
        tg.start_soon(watch)
    return None if gone or not result else result[0]

"""A server-sent-events response that always closes its generator, so a client that disconnects mid-stream
aborts its request at once (its KV blocks are freed) instead of whenever the generator is garbage collected."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()  # cancels the stream: the generator sees CancelledError and aborts

            tg.start_soon(watch_disconnect)
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client is gone; the generator is closed below
            finally:
                with anyio.CancelScope(shield=True):
                    aclose = getattr(self._events, "aclose", None)
                    if aclose is not None:
                        await aclose()
            tg.cancel_scope.cancel()

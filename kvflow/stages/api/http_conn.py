"""Slow clients on the HTTP front: uvicorn's httptools protocol with read deadlines.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but waits forever for a
request's headers and body. Here a connection must deliver its request line and headers
within ``header_timeout_s`` of opening (or of its last answer, on a kept-alive connection),
else it is closed; and a request's body must be in within ``body_timeout_s`` of its headers,
else it is answered 408 and closed (unless the answer has begun). A slow-header attack then
holds a socket for ``header_timeout_s`` at most."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) with these deadlines."""

    class TimedHttpProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, what)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, what: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            logger.info("HTTP client %s: %s not in time; closing", self.client, what)
            cycle = self.cycle
            if what == "body" and cycle is not None and not cycle.response_started:
                msg = b'{"error": {"message": "request body not received in time", "code": 408}}'
                self.transport.write(_TIMEOUT_408 % (len(msg), msg))
            self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(header_timeout_s, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_timeout_s, "body")

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle = self.cycle is None or self.cycle.response_complete  # no pipelined request
            if idle and not self.transport.is_closing():
                self._arm(header_timeout_s, "headers")

    return TimedHttpProtocol

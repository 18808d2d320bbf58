"""Connections a client cannot hold open for nothing: uvicorn's h11 protocol with read deadlines.

uvicorn closes a connection idle between requests after timeout_keep_alive, but waits without
end for a request's head (a client that connects and sends nothing, or sends its headers a byte
at a time) and for a body that stops arriving. Here a request's head must be complete within
timeout_read of the connection or of its first byte, and a body may pause at most timeout_read
(not counted while the server itself has paused reading); past either the connection is closed.
A connection upgraded to a WebSocket (glm_asr.serve's /v1/realtime) leaves these deadlines.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11(timeout_read: float) -> type[asyncio.Protocol]:
    """An H11Protocol class whose connections keep the deadlines above (timeout_read seconds)."""

    class TimedH11Protocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.get_protocol() is not self:
                return self._disarm()           # upgraded to a WebSocket: its own protocol from here on
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._arm(again=True)           # a body: the longest pause counts
            elif state is h11.IDLE and self.deadline is None and self.conn.trailing_data[0]:
                self._arm()                     # a new head begun: it must end in time
            elif state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, again: bool = False) -> None:
            if again:
                self._disarm()
            if self.deadline is None:
                self.deadline = self.loop.call_later(timeout_read, self._expire)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            self.deadline = None
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.SEND_BODY and self.flow.read_paused:
                return self._arm()              # the server is behind, not the client
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                self.transport.close()

    return TimedH11Protocol

"""Which client still waits, and when a sequence's KV is really gone (issue 50).

mlx-lm's generation thread removes a sequence whose context was stopped (``ctx.stop()``) at
the end of the batch step it is in, that is within one prefill chunk or one decode step. Two
things around it are Velox's:

- :func:`client_gone` notices a client that hung up, streaming or not, without writing to it
  (a non-streaming reply writes nothing until the end, and the first write to a closed socket
  often succeeds). The generation thread asks it of every live request before each batch step
  (:meth:`SequenceTracker.stopped`), so a sequence whose client left is removed at the end of
  the chunk in progress, never after another one; the handler also polls it while it waits,
  to end its side.
- :class:`SequenceTracker` learns, from the generation thread, when a request's sequence has
  left the batch (removed or finished), so that its memory reservation is released then, not
  when the handler gives up on it.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Sequence
from typing import Any

from mlx_lm.server import GenerationContext

FREE_WAIT_S = 900.0  # the longest a handler waits for its cancelled sequence to leave the batch


class ClientGone(ConnectionResetError):
    """The client closed its connection while its request was still running (noticed by a
    peek at the socket, before a write to it could fail)."""


def client_gone(sock: socket.socket | None) -> bool:
    """Whether the peer of ``sock`` has closed (or reset) the connection. Never blocks and
    never consumes data: a readable socket is peeked at; ``b""`` means the peer closed."""
    if sock is None:
        return False
    try:
        if sock.fileno() < 0:
            return True
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or closed under us
        return True


class Freed:
    """Set once the request's sequence is no longer in the batch (``ctx.freed``)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def set(self) -> None:
        self.event.set()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)


def freed_of(ctx: Any) -> Freed | None:
    """The :class:`Freed` the tracker attached to ``ctx`` (``None`` for a context it never
    saw, e.g. a test's stand-in)."""
    freed = ctx.__dict__.get("velox_freed") if hasattr(ctx, "__dict__") else None
    return freed if isinstance(freed, Freed) else None


class TrackedQueue:
    """A request's response queue as the generation thread sees it: forwards every ``put`` and
    attaches a :class:`Freed` to the request's :class:`GenerationContext` on its way out."""

    def __init__(
        self, inner: Any, tracker: SequenceTracker, sock: socket.socket | None = None
    ) -> None:
        self.inner = inner
        self.tracker = tracker
        self.socket = sock  # the client's connection, if the handler registered it
        self.ctx: GenerationContext | None = None
        self.alone = False  # served by the one-at-a-time path (set by the generator)

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        stopped = self.ctx is not None and self.ctx._should_stop
        if self.alone and stopped and isinstance(item, tuple):
            # a prefill progress report of a cancelled request: end its prefill here (the
            # one-at-a-time path checks the stop flag only between generated tokens)
            raise ClientGone("the request was cancelled during its prefill")
        if isinstance(item, GenerationContext):
            item.velox_freed = Freed()  # type: ignore[attr-defined]
            self.ctx = item
            self.tracker.last = self
        self.inner.put(item, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get, empty, ... of the real queue
        return getattr(self.inner, name)


class SequenceTracker:
    """Maps the batch generator's uids to their requests' contexts (generation thread only)
    and marks each context freed when its uid leaves the batch."""

    def __init__(self) -> None:
        self.last: TrackedQueue | None = None  # the queue whose context was put just before
        self.queues: dict[int, TrackedQueue] = {}  # live uid -> its request's queue
        self.sockets: dict[int, socket.socket] = {}  # id(request) -> client, until taken

    def register(self, request: Any, sock: socket.socket | None) -> None:
        """Handler thread, before queueing ``request``: its client's connection."""
        if sock is not None:
            self.sockets[id(request)] = sock

    def forget(self, request: Any) -> None:
        """Handler thread: ``request`` never reached the generation thread."""
        self.sockets.pop(id(request), None)

    def wrap(self, request: Any) -> Any:
        """``_next_request``'s ``(queue, request, args)`` with the queue tracked."""
        if request is None:
            return None
        rqueue, body, *rest = request
        return (TrackedQueue(rqueue, self, self.sockets.pop(id(body), None)), body, *rest)

    def inserted(self, uids: Sequence[int]) -> None:
        rqueue, self.last = self.last, None
        if rqueue is not None:
            for uid in uids:
                self.queues[uid] = rqueue

    def stopped(self) -> list[int]:
        """Live uids to remove now: their context was stopped, or their client left (which
        stops the context)."""
        out = []
        for uid, rqueue in self.queues.items():
            ctx = rqueue.ctx
            if ctx is None:
                continue
            if not ctx._should_stop and client_gone(rqueue.socket):
                ctx.stop()
            if ctx._should_stop:
                out.append(uid)
        return out

    def freed(self, uids: Sequence[int]) -> None:
        for uid in uids:
            rqueue = self.queues.pop(uid, None)
            freed = None if rqueue is None or rqueue.ctx is None else freed_of(rqueue.ctx)
            if freed is not None:
                freed.set()

    def served_alone(self, request: Any) -> None:
        """The one-at-a-time path returned: its sequence is gone."""
        rqueue = request[0] if request else None
        ctx = rqueue.ctx if isinstance(rqueue, TrackedQueue) else None
        freed = None if ctx is None else freed_of(ctx)
        if freed is not None:
            freed.set()

    def clear(self) -> None:
        """The batch generator closed: every sequence it held is gone."""
        self.freed(list(self.queues))

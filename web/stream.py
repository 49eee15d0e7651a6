"""One SSE client's response body: the replay written in few, uncopied chunks, then the live
queue with ``: ping`` comments.

Apart from the routes because it is the one part of the app that blocks: under gevent a
client waiting in its queue costs a greenlet, and the greenlet is handed to the hub so that
a client too slow to keep up can be dropped (:meth:`web.hub.Hub.drop`). The bytes
themselves are formatted in :mod:`web.sse` and encoded once in the hub.
"""
from __future__ import annotations

import time
from typing import Iterator

import gevent
import gevent.queue

from web import sse
from web.runstate import Subscriber
from web.shards import AnyHub

#: Replay chunks under this size are joined into one write; bigger ones are written as they
#: are. See :func:`replay`.
COALESCE_BYTES = 4096


def replay(chunks: list[bytes]) -> Iterator[bytes]:
    """The replay as writes: each big chunk (an epoch record, encoded once in the hub and
    shared by every client) is yielded itself, never copied; runs of small chunks (``retry``,
    the header, small records) are joined, so a client costs a few writes rather than one
    per chunk. The per-client copy is bounded by about ``COALESCE_BYTES`` (joining the whole
    replay was a copy of every record per client, most of the web's memory per client). The
    list is emptied as it goes, so nothing of the replay stays referenced by the stream."""
    small: list[bytes] = []
    size = 0
    chunks.reverse()
    while chunks:
        chunk = chunks.pop()
        if len(chunk) >= COALESCE_BYTES:
            if small:
                yield small[0] if len(small) == 1 else b"".join(small)
                small, size = [], 0
            yield chunk
            continue
        small.append(chunk)
        size += len(chunk)
        if size >= COALESCE_BYTES:
            yield b"".join(small)
            small, size = [], 0
    if small:
        yield small[0] if len(small) == 1 else b"".join(small)


def client_stream(hub: AnyHub, sub: Subscriber, initial: list[bytes], last: int,
                  ping_interval: float) -> Iterator[bytes]:
    """One client's SSE body: the replay, then live items with ids above ``last``, with a
    ``: ping`` whenever ``ping_interval`` has passed since the previous one."""
    current = gevent.getcurrent()
    if isinstance(current, gevent.Greenlet):  # pywsgi's handler: killed if the client is dropped
        sub.greenlet = current
    try:
        yield from replay(initial)
        next_ping = time.monotonic() + ping_interval
        while True:
            now = time.monotonic()
            if now >= next_ping:
                yield sse.PING
                next_ping = now + ping_interval
            try:
                item = sub.queue.get(timeout=max(0.001, next_ping - time.monotonic()))
            except gevent.queue.Empty:
                continue
            if item is None:  # closed by the hub: dropped, run gone, or shutdown
                return
            sub.taken(item)
            seq, data = item
            if seq > last:
                last = seq
                yield data
    finally:
        sub.greenlet = None
        hub.unsubscribe(sub)

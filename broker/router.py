"""The broker's ROUTER requests: run snapshots for the webs, and requests for dumps to
forward to a run's ranks (Clone pattern, docs/DESIGN.md "The feed" and "Requests for dumps").

Split from :mod:`broker.server`, which owns the sockets and gives this a slice of each loop
turn: what a request means is decided here. Snapshots come from the encoded cache
(:mod:`broker.snapshots`); a request for dumps is judged by
:class:`~broker.stacks.requests.ForwardGate` (who may ask, for which run, how often) and its
bytes forwarded unchanged on the publish socket.
"""
from __future__ import annotations

import logging
import time

import zmq

from broker import feed
from broker.runs import Runs
from broker.snapshots import SnapshotCache
from broker.stacks.requests import ForwardGate
from rank_agent.controlauth import sign_request
from rank_agent.controlwire import control_topic
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["RouterRequests"]

log = logging.getLogger(__name__)


class RouterRequests:
    """What the broker answers on its ROUTER (see the module docstring)."""

    def __init__(self, runs: Runs, snapshots: SnapshotCache, gate: ForwardGate,
                 rlog: RateLimitedLog, instance: str) -> None:
        self.runs = runs
        self.snapshots = snapshots
        self.gate = gate
        self._rlog = rlog
        self.instance = instance
        #: the control secret (rank_agent/controlauth.py): requests for dumps are forwarded
        #: signed with it (set by the server at bind); None: forwarded as the web encoded them
        self.control_key: bytes | None = None

    def forward_stacks_request(self, pub: zmq.Socket, body: list[bytes],
                               user_id: str | None) -> None:
        """A request for dumps (docs/DESIGN.md "Requests for dumps"): checked, judged by
        :class:`~broker.stacks.requests.ForwardGate` (who, which run, how often) and, if
        admitted, its bytes forwarded unchanged to the run's agents on the publish socket.
        Refusals are counted and logged at most once per reason per 10 s."""
        try:
            req, raw = feed.decode_stacks_request(body)
        except feed.FeedError as exc:
            self.gate.refuse("malformed")
            self._rlog.warning("stacks_malformed", "bad stacks request refused: %s", exc)
            return
        refused = self.gate.admit(req, user_id, self.runs.get(req.run) is not None,
                                         time.monotonic())
        if refused is not None:
            self._rlog.warning(("stacks_refused", refused), "stacks request for run %r refused "
                               "(%s)", req.run, refused)
            return
        key = self.control_key
        pub.send_multipart([control_topic(req.run), raw] if key is None
                           else sign_request(key, req, time.time()))
        self._rlog.log(("stacks_forwarded", req.run), logging.INFO,
                       "stacks request %s (%s) forwarded to run %r, ranks %s", req.request_id,
                       req.kind, req.run, "all" if req.ranks is None else len(req.ranks))

    def serve(self, router: zmq.Socket, pub: zmq.Socket, curve: bool, deadline: float) -> None:
        """Answer pending snapshot requests (one RUN per run, then END) and forward requests
        for dumps, until ``deadline`` (``time.monotonic``); the rest wait in the socket.

        Replies are sent zero-copy: the parts of a cached snapshot are shared by every reply
        queued for it, so N requests from a client that does not read hold one copy, not N.
        """
        for _ in range(100):
            if time.monotonic() >= deadline:
                return
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0].bytes, [f.bytes for f in frames[1:]]
            envelope: list[bytes] = [identity]
            if body and body[0] == b"":  # a REQ-style delimiter: keep it in the reply
                envelope.append(b"")
                body = body[1:]
            if body and body[0] == feed.STACKS:  # the peer's key: ZAP's User-Id (CURVE)
                user = frames[-1].get("User-Id") if curve else None
                self.forward_stacks_request(pub, body, None if user is None else str(user))
                continue
            try:
                run = feed.decode_snapshot_request(body)
            except feed.FeedError as exc:
                self._rlog.warning("snapshot_request", "bad snapshot request: %s", exc)
                continue
            if run is None:
                sinks = self.runs.sinks()
            else:
                one = self.runs.get(run)
                sinks = [] if one is None else [one]
            encoded = self.snapshots.encoded(sinks)
            try:
                for parts in encoded:
                    router.send_multipart(envelope + parts, zmq.NOBLOCK, copy=False)
                end = feed.encode_snapshot_end(self.instance, len(encoded))
                router.send_multipart(envelope + end, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH / EAGAIN: peer gone or not reading
                self._rlog.warning("snapshot_send", "snapshot reply abandoned: %s", exc.strerror)
            log.debug("snapshot of %s: %d runs", run or "all runs", len(encoded))

"""The broker -> web feed codec (docs/DESIGN.md "The feed"): PUB topics and snapshot messages.

Both sides import this module: the broker to encode, the web (under gevent) to decode. It
therefore imports only msgspec and the standard library, never zmq, the sink or the web
(the request type, ``rank_agent.controlwire``, only where the broker decodes a request:
importing ``rank_agent`` starts the agent's package, zmq and all).
Messages are lists of ``bytes`` parts, ready for ``send_multipart``/``recv_multipart``.

PUB topics (first part):

* ``b"r:" + run`` -> ``{"seq", "kind", "data"}``: one sink event;
* ``b"!hb"`` -> ``{"instance", "time", "accepted", "rejected", "late_metrics", "runs",
  "late_steps", "steps_closed"}``: every second;
* ``b"!port"`` -> ``{"run", "rank", "port"}``: an accepted ``register`` naming a non-zero port
  (for ``rankboard up``'s lazy web bind).

Snapshot (DEALER -> ROUTER): ``[b"SNAP"]`` or ``[b"SNAP", run]``; answered by one
``[b"RUN", run snapshot]`` per run, then ``[b"END", {"instance", "runs"}]``.

Requests for dumps (DEALER -> ROUTER, PROTOCOL.md section 2.5): ``[b"STACKS", body]``, the
body a :class:`rank_agent.controlwire.ControlRequest` as the web encoded it, never answered
on this socket: the broker checks it and forwards the same bytes to the run's agents on the
PUB socket (``b"!ctl:" + run + b"!"``, a topic a web ignores); the answers come back as
``stacks`` events. The feed's PUB messages also carry those control topics: a web
subscribed to everything decodes them as unknown (``decode_update`` returns None).

The encoder and decoder are built once (msgspec perf tips) and each event is encoded once,
however many subscribers receive it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Union

import msgspec

if TYPE_CHECKING:
    from rank_agent.controlwire import ControlRequest

__all__ = [
    "RUN_PREFIX",
    "TOPIC_HEARTBEAT",
    "TOPIC_PORT",
    "SNAP",
    "RUN",
    "END",
    "FeedError",
    "EventUpdate",
    "Heartbeat",
    "PortUpdate",
    "Update",
    "encode_event",
    "encode_heartbeat",
    "encode_port",
    "decode_update",
    "encode_snapshot_request",
    "decode_snapshot_request",
    "encode_run_snapshot",
    "encode_snapshot_end",
    "decode_snapshot_reply",
    "STACKS",
    "encode_stacks_request",
    "decode_stacks_request",
]

#: Topic prefix of run events; run ids never contain ``!`` so the ``!`` topics cannot collide.
RUN_PREFIX = b"r:"
TOPIC_HEARTBEAT = b"!hb"
TOPIC_PORT = b"!port"
#: Snapshot verbs (first part after the ROUTER's identity envelope).
SNAP = b"SNAP"
RUN = b"RUN"
END = b"END"
#: The web's request for dumps (module docstring).
STACKS = b"STACKS"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class FeedError(ValueError):
    """A feed message that does not have the documented shape."""


class EventUpdate(NamedTuple):
    """One sink event of one run, as the web receives it."""

    run: str
    seq: int
    kind: str
    data: Any


class Heartbeat(NamedTuple):
    """The broker's once-a-second liveness and counters (totals since ``instance`` started)."""

    instance: str
    time: float
    accepted: int
    rejected: dict[str, int]
    late_metrics: int
    runs: int
    late_steps: int = 0
    steps_closed: int = 0
    # (v3) Alert webhooks (PROTOCOL 3.1) and the journal's limits and repairs; absent from
    # an older broker's heartbeat, so they default to 0 / {}.
    webhooks_sent: int = 0
    webhooks_failed: int = 0
    webhooks_dropped: int = 0
    #: :data:`JOURNAL_COUNTERS` -> count (empty without a journal)
    journal: Mapping[str, int] = {}


#: The journal's counters a heartbeat carries (``Journal.counters()``, since start).
JOURNAL_COUNTERS = ("early_flushes", "dropped_bytes", "damaged_entries", "runs_not_loaded",
                    "write_failures", "unreplayable_entries", "failing")


class PortUpdate(NamedTuple):
    """An accepted ``register`` frame that named a non-zero port."""

    run: str
    rank: int
    port: int


Update = Union[EventUpdate, Heartbeat, PortUpdate]


def _pack(obj: Any) -> bytes:
    return _encoder.encode(obj)


def _unpack(payload: bytes, what: str) -> Any:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise FeedError(f"{what}: not MessagePack: {exc}") from None


def encode_event(run: str, event: Any) -> list[bytes]:
    """PUB message of one sink event (anything with ``seq``, ``kind``, ``data``, e.g.
    ``broker.run.sink.Event``; not imported here to keep this module msgspec-only)."""
    body = {"seq": event.seq, "kind": event.kind, "data": event.data}
    return [RUN_PREFIX + run.encode(), _pack(body)]


def encode_heartbeat(
    instance: str,
    time: float,
    accepted: int,
    rejected: dict[str, int],
    runs: int,
    late_metrics: int = 0,
    late_steps: int = 0,
    steps_closed: int = 0,
    *,
    webhooks_sent: int = 0,
    webhooks_failed: int = 0,
    webhooks_dropped: int = 0,
    journal: Mapping[str, int] | None = None,
) -> list[bytes]:
    """PUB heartbeat message; ``rejected`` maps reason -> count. Fields added later are
    additive: a decoder that does not know them ignores them."""
    body = {
        "instance": instance,
        "time": time,
        "accepted": accepted,
        "rejected": dict(rejected),
        "late_metrics": late_metrics,
        "late_steps": late_steps,
        "steps_closed": steps_closed,
        "runs": runs,
        "webhooks_sent": webhooks_sent,
        "webhooks_failed": webhooks_failed,
        "webhooks_dropped": webhooks_dropped,
        "journal": dict(journal or {}),
    }
    return [TOPIC_HEARTBEAT, _pack(body)]


def encode_port(run: str, rank: int, port: int) -> list[bytes]:
    """PUB message announcing a registered port."""
    return [TOPIC_PORT, _pack({"run": run, "rank": rank, "port": port})]


def decode_update(parts: list[bytes]) -> Update | None:
    """Decode one PUB message.

    Returns ``None`` for a topic this version does not know (``!`` topics added later), so a
    newer broker does not break an older web; raises :class:`FeedError` for a known topic
    whose body is malformed.
    """
    if len(parts) != 2:
        raise FeedError(f"feed message has {len(parts)} parts, expected 2")
    topic, payload = parts
    if topic.startswith(RUN_PREFIX):
        body = _unpack(payload, "event")
        try:
            return EventUpdate(
                topic[len(RUN_PREFIX):].decode(), int(body["seq"]), str(body["kind"]), body["data"]
            )
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise FeedError(f"malformed event: {exc!r}") from None
    if topic == TOPIC_HEARTBEAT:
        body = _unpack(payload, "heartbeat")
        try:
            return Heartbeat(
                str(body["instance"]),
                float(body["time"]),
                int(body["accepted"]),
                {str(k): int(v) for k, v in body["rejected"].items()},
                int(body.get("late_metrics", 0)),
                int(body["runs"]),
                int(body.get("late_steps", 0)),
                int(body.get("steps_closed", 0)),
                int(body.get("webhooks_sent", 0)),
                int(body.get("webhooks_failed", 0)),
                int(body.get("webhooks_dropped", 0)),
                {str(k): int(v) for k, v in (body.get("journal") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FeedError(f"malformed heartbeat: {exc!r}") from None
    if topic == TOPIC_PORT:
        body = _unpack(payload, "port")
        try:
            return PortUpdate(str(body["run"]), int(body["rank"]), int(body["port"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FeedError(f"malformed port: {exc!r}") from None
    return None


def encode_snapshot_request(run: str | None = None) -> list[bytes]:
    """DEALER request: all runs (``run`` None) or one run."""
    return [SNAP] if run is None else [SNAP, run.encode()]


def decode_snapshot_request(parts: list[bytes]) -> str | None:
    """The run a request asks for (``None`` = all); raises :class:`FeedError` if malformed."""
    if not parts or parts[0] != SNAP or len(parts) > 2:
        raise FeedError("snapshot request must be [SNAP] or [SNAP, run]")
    if len(parts) == 1:
        return None
    try:
        return parts[1].decode()
    except UnicodeDecodeError:
        raise FeedError("snapshot request run is not UTF-8") from None


def encode_run_snapshot(snapshot: dict[str, Any]) -> list[bytes]:
    """One ``RUN`` reply part pair: a ``RunSink.snapshot()`` dict."""
    return [RUN, _pack(snapshot)]


def encode_snapshot_end(instance: str, runs: int) -> list[bytes]:
    """The closing ``END`` reply: the broker instance and how many ``RUN`` messages preceded it."""
    return [END, _pack({"instance": instance, "runs": runs})]


def decode_snapshot_reply(parts: list[bytes]) -> tuple[str, dict[str, Any]]:
    """``("RUN", run snapshot)`` or ``("END", {"instance", "runs"})``; :class:`FeedError` otherwise."""
    if len(parts) != 2 or parts[0] not in (RUN, END):
        raise FeedError("snapshot reply must be [RUN, snapshot] or [END, info]")
    body = _unpack(parts[1], parts[0].decode())
    if not isinstance(body, dict):
        raise FeedError("snapshot reply body is not a map")
    return parts[0].decode(), body


def encode_stacks_request(req: ControlRequest) -> list[bytes]:
    """DEALER message asking the broker to forward ``req`` to its run's ranks: the request
    is encoded here, once (module docstring), as ``controlwire.encode_body`` would."""
    return [STACKS, _pack(req)]


def decode_stacks_request(parts: list[bytes]) -> tuple[ControlRequest, bytes]:
    """The request and its body bytes (to forward unchanged); :class:`FeedError` if the
    message is not ``[STACKS, body]`` or the body is not a request the agents accept."""
    from rank_agent.controlwire import decode_body

    if len(parts) != 2 or parts[0] != STACKS:
        raise FeedError("stacks request must be [STACKS, body]")
    try:
        return decode_body(parts[1]), parts[1]
    except ValueError as exc:  # ControlError
        raise FeedError(str(exc)) from None

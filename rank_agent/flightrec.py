"""PyTorch's Flight Recorder, read live: the ``collectives`` frame (PROTOCOL.md section 7.2).

Every process group numbers its collectives (``collective_seq_id``) and the Flight Recorder
keeps the last ones; in a hang the rank that is behind has the lower number. The agent reads
the recorder whenever it sends a ``stacks`` frame (a stall dump or a request's answer) and
sends what it found as a ``collectives`` frame with the same ``reason`` and ``request_id``.

What is read (all private API of torch, measured on torch 2.13 CPU):

* the NCCL recorder, ``torch._C._distributed_c10d._dump_nccl_trace_json(True, False)``,
  where it exists (CUDA builds) and holds entries; else
* the generic recorder of torch >= 2.8, ``_dump_fr_trace_json(include_collectives=True,
  only_active=False)``, which records gloo. It records by default (2,000 entries; the
  environment variable ``TORCH_FR_BUFFER_SIZE``, or ``TORCH_NCCL_TRACE_BUFFER_SIZE``, sets the
  size, and 0 turns it off; then there is nothing to send).

Both give JSON: ``pg_status`` (per group id, ``last_enqueued_collective`` and
``last_completed_collective``, **as strings**), ``pg_config`` (per group name, ``desc`` and
``ranks`` as a string such as ``"[0, 1, 2]"``; on gloo it is often keyed ``""`` and then says
nothing about a group) and ``entries`` (``process_group`` = [id, desc], ``collective_seq_id``,
``profiling_name``, ``input_sizes``, ``state`` (stays ``scheduled`` on gloo), ``retired``,
``is_p2p``). Point-to-point entries are left out: their numbers are not collective sequence
numbers. Each group keeps its newest 64 entries; strings are cut to 128 characters and
sizes to 16 x 16, so the frame fits the wire's bounds by construction.

The agent never imports torch: it looks in ``sys.modules``. Reading costs about 0.05 ms
for the status and 40 ms for 2,000 entries, on the agent's thread, only with a dump. No
recorder, no initialised default group, or any error (the API is private and changes): no
frame, the error logged once, nothing reaches the training loop.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import msgspec

from .digits import ascii_int
from .protocol import (
    MAX_COLLECTIVE_ENTRIES,
    MAX_COLLECTIVE_GROUPS,
    MAX_COLLECTIVE_TEXT,
    MAX_ENTRY_SIZES,
    MAX_SIZE_DIMS,
    CollectiveEntry,
    Collectives,
    ProcessGroupStatus,
    Stacks,
)

__all__ = ["read_trace", "collectives_frame", "send_collectives", "FlightRecorder"]

log = logging.getLogger(__name__)

_json_decode = msgspec.json.Decoder().decode


def _cut(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_COLLECTIVE_TEXT]


def _int(value: Any, default: int = -1) -> int:
    """A number of the dump (an int, or an int as a string); ``default`` when not one."""
    if type(value) is int:
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


def _sizes(value: Any) -> List[List[int]]:
    if not isinstance(value, list):
        return []
    out = []
    for size in value[:MAX_ENTRY_SIZES]:
        if isinstance(size, list):
            out.append([d if type(d) is int else _int(d, 0) for d in size[:MAX_SIZE_DIMS]])
    return out


def _group_size(ranks: Any) -> int:
    """The number of ranks ``pg_config`` lists (``"[0, 1, 2]"`` or a list); 0 unknown."""
    if isinstance(ranks, list):
        return len(ranks)
    if isinstance(ranks, str):
        inner = ranks.strip().strip("[]").strip()
        return len(inner.split(",")) if inner else 0
    return 0


def _pg_order(pg: str) -> tuple[int, int, str]:
    number = ascii_int(pg, 18)  # (not str.isdigit: "²" is a digit int() refuses)
    return (1, 0, pg) if number is None else (0, number, "")


def collectives_frame(data: Mapping[str, Any], run: str, rank: int, reason: str,
                      request_id: str = "", taken_at: Optional[float] = None
                      ) -> Optional[Collectives]:
    """The ``collectives`` frame of a decoded Flight Recorder dump; None when it names no
    process group."""
    status = data.get("pg_status")
    if not isinstance(status, dict) or not status:
        return None
    config = data.get("pg_config")
    config = config if isinstance(config, dict) else {}
    pgs = sorted((str(pg) for pg in status), key=_pg_order)[:MAX_COLLECTIVE_GROUPS]
    by_pg: Dict[str, List[Any]] = {pg: [] for pg in pgs}
    descs: Dict[str, str] = {}
    entries = data.get("entries")
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        group = e.get("process_group")
        if isinstance(group, list) and group:
            pg = str(group[0])
            if len(group) > 1 and pg not in descs and isinstance(group[1], str):
                descs[pg] = group[1]
        else:
            pg = str(e.get("pg_id", ""))
        found = by_pg.get(pg)
        if found is not None:
            found.append(e)
    groups = []
    chosen: List[CollectiveEntry] = []
    for pg in pgs:
        st = status[pg] if pg in status else {}
        st = st if isinstance(st, dict) else {}
        conf = config.get(pg)
        conf = conf if isinstance(conf, dict) else {}
        groups.append(ProcessGroupStatus(
            pg=_cut(pg), desc=_cut(conf.get("desc") or descs.get(pg, "")),
            size=_group_size(conf.get("ranks")),
            last_enqueued=_int(st.get("last_enqueued_collective")),
            last_completed=_int(st.get("last_completed_collective"))))
        mine = [(_int(e.get("collective_seq_id")), e) for e in by_pg[pg]]
        mine.sort(key=lambda pair: pair[0])
        for seq, e in mine[-MAX_COLLECTIVE_ENTRIES:]:
            chosen.append(CollectiveEntry(
                pg=_cut(pg), seq=seq, op=_cut(e.get("profiling_name") or ""),
                input_sizes=_sizes(e.get("input_sizes")), state=_cut(e.get("state") or ""),
                retired=bool(e.get("retired"))))
    return Collectives(run=run, rank=rank, reason=reason,  # type: ignore[arg-type]
                       request_id=request_id,
                       taken_at=time.time() if taken_at is None else taken_at,
                       groups=groups, entries=chosen)


def _loads(raw: Any) -> Optional[Dict[str, Any]]:
    """The dump's JSON, decoded by msgspec (a third of ``json.loads``'s time on the ~1 MB of
    a full ring)."""
    data = _json_decode(raw)
    return data if isinstance(data, dict) else None


def read_trace(modules: Mapping[str, Any] = sys.modules) -> Optional[Dict[str, Any]]:
    """The process's Flight Recorder dump, decoded; None when torch is not imported, no
    default group is initialised or there is no recorder. Raises what torch raises."""
    torch = modules.get("torch")
    dist = modules.get("torch.distributed")
    if torch is None or dist is None:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    if c10d is None:
        return None
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)
    if nccl is not None:
        try:
            data = _loads(nccl(True, False))
        except Exception:  # a CUDA build without NCCL in use: the generic one may hold it
            data = None
        if data and data.get("entries"):
            return data
    generic = getattr(c10d, "_dump_fr_trace_json", None)
    if generic is None:
        return None
    return _loads(generic(True, False))


class FlightRecorder:
    """Reads the recorder and sends the frame beside a ``stacks`` frame; the first failure
    is logged (a warning), later ones at debug level: a private API that changed fails on
    every dump, and the user needs to hear it once."""

    def __init__(self, read: Callable[[], Optional[Dict[str, Any]]] = read_trace) -> None:
        self._read = read
        self.sent = 0
        self.failures = 0

    def send_beside(self, send: Callable[[Any], Any], stacks: Stacks) -> bool:
        """Send the ``collectives`` frame that goes with ``stacks`` (same reason and
        request id) through ``send``; True if one was sent. Never raises."""
        try:
            data = self._read()
            if data is None:
                return False
            frame = collectives_frame(data, stacks.run, stacks.rank, stacks.reason,
                                      stacks.request_id)
            if frame is None:
                return False
            send(frame)
            self.sent += 1
            return True
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("rankboard: reading the Flight Recorder failed, no collectives "
                            "sent (logged once): %r", exc)
            else:
                log.debug("rankboard: reading the Flight Recorder failed: %r", exc)
            return False


#: The process's reader (the stall watch and the control channel share it, so a failure is
#: logged once per process).
_RECORDER = FlightRecorder()


def send_collectives(send: Callable[[Any], Any], stacks: Stacks) -> bool:
    """:meth:`FlightRecorder.send_beside` of the process's reader."""
    return _RECORDER.send_beside(send, stacks)

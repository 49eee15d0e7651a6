"""One run's ``collectives`` frames and the collective verdict (PROTOCOL.md section 7.2).

Python stacks show every rank of a hang inside ``all_reduce``; they do not show which rank
never arrived. The Flight Recorder does: each process group numbers its collectives, and the
rank that is behind has the lower number. This module holds what the broker makes of it:

* :class:`RunCollectives`: each rank's latest frame per reason, kept as its JSON-ready dict
  (what ``GET /collectives`` lists and the feed carries) plus a **digest**: per group the two
  sequence numbers and the entries by ``seq``, built once when the frame arrives, so that a
  verdict over 1,024 ranks is a few dict lookups a rank and group, not a pass over 262,144
  entries. Bounded in bytes per run (:data:`MAX_RUN_COLLECTIVES_BYTES`) and, across runs, by
  the process's byte budget (:mod:`broker.budget`, shared with the dumps: a per-run cap times
  ``--max-runs`` bounds nothing), as dumps are; a frame the budget drops is reported by
  :meth:`RunCollectives.take_gone`, so the web learns that its rank has none.
* :func:`collective_verdict`: the rules of 7.2 over the ranks whose frame is current (the
  caller knows which: it sees the ``steps``/``metrics`` frames).
* :func:`verdict_alerts`: which ranks raise ``collective_behind``/``collective_mismatch`` when
  one verdict replaces another (a rank entering ``behind``/``mismatched``, or every listed
  rank when its group's ``seq`` changed), with the contract's messages.

Pure: no I/O, no clock.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from broker import budget as _budget
from rank_agent.digits import ascii_int
from rank_agent.protocol import Collectives
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["RunCollectives", "Digest", "digest_of", "wire_of", "collective_verdict",
           "verdict_alerts", "pg_order", "MAX_RUN_COLLECTIVES_BYTES", "held_bytes"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

#: The most bytes one run's kept frames may hold (:func:`held_bytes` each, what they cost in
#: memory): 1,024 ranks' frames of a few groups each; a typical frame (a few groups) is a
#: few KiB held, a maximal one (64 groups of 64 entries) about 3.5 MB. Beyond it new frames
#: are counted, not kept.
MAX_RUN_COLLECTIVES_BYTES = 64 * 1024 * 1024
#: What one kept frame costs beyond its encoded size (its digest's dicts and tuples). Kept
#: for older callers; the count is :func:`held_bytes` now (issue 38).
FRAME_OVERHEAD = 512
#: What holding a frame costs in this process, in bytes, by part (CPython 3.11, 64-bit,
#: measured with tracemalloc over frames of 0-64 groups, 0-64 entries a group, 0-16 sizes of
#: 0-16 dimensions, ASCII and CJK text, with a verdict's keys made; docs in held_bytes). Each
#: is rounded up from the measured figure so that the count is an upper bound.
HELD_FRAME = 1280  # the wire dict, its two lists, the digest dict, the budget's slot (947)
HELD_GROUP = 800  # a group's wire dict, digest list, two dicts, a verdict's key (~780)
HELD_ENTRY = 512  # an entry's wire dict, its sizes list, its digest slot (~430 + strings)
HELD_SIZES = 120  # one size list, and its tuple in a verdict's key (56 + 48)
HELD_DIM = 48  # one dimension: an int object, its slot in the list and in the key tuple
HELD_STR = 56  # an ASCII str's header (49, rounded), then 1 byte a character
HELD_WIDE_STR = 80  # another str's header (74-76, rounded), then up to 4 bytes a character

#: A group's digest: [last_enqueued, last_completed, desc, size, {seq: entry (wire form)},
#: top op (the op of its highest-seq entry, "" none), {seq: (op, sizes as tuples)}: the
#: hashable keys, made when a verdict first needs one and kept with the frame, so a verdict
#: recomputed over the same frames (a rank moved on) does not make them again].
Group = List[Any]
#: A frame's digest: pg -> :data:`Group`.
Digest = Dict[str, Group]


def wire_of(frame: Collectives) -> Dict[str, Any]:
    """A decoded ``collectives`` frame as ``GET /collectives`` lists it (known fields only)."""
    return {
        "rank": frame.rank, "reason": frame.reason, "request_id": frame.request_id,
        "taken_at": frame.taken_at,
        "groups": [{"pg": g.pg, "desc": g.desc, "size": g.size,
                    "last_enqueued": g.last_enqueued, "last_completed": g.last_completed}
                   for g in frame.groups],
        "entries": [{"pg": e.pg, "seq": e.seq, "op": e.op, "input_sizes": e.input_sizes,
                     "state": e.state, "retired": e.retired} for e in frame.entries],
    }


def _text_bytes(text: str) -> int:
    """What a str held costs: its header, and its characters at 1 byte (ASCII) or up to 4."""
    return HELD_STR + len(text) if text.isascii() else HELD_WIDE_STR + 4 * len(text)


def held_bytes(item: Mapping[str, Any]) -> int:
    """An upper bound of the bytes this process holds for a kept frame in wire form (its
    dicts, lists, ints and strings, and its digest), from its counts: what the run's cap and
    the process's byte budget are charged.

    Why not the encoded size, as before: a frame is held as Python objects, 3-9 times its
    MessagePack size (a 64 x 64 frame of 2 sizes: 3.5 MB held, 0.39 MB charged), so a 256
    MiB budget let the broker and the web each reach ~1.85 GiB (issue 38). Why not a deep
    ``sys.getsizeof`` walk: it costs several times the encoding it replaces; counting parts
    is one pass over the entries."""
    n = HELD_FRAME + _text_bytes(item["request_id"])
    for g in item["groups"]:
        n += HELD_GROUP + _text_bytes(g["pg"]) + _text_bytes(g["desc"])
    for e in item["entries"]:
        sizes = e["input_sizes"]
        n += (HELD_ENTRY + _text_bytes(e["pg"]) + _text_bytes(e["op"])
              + _text_bytes(e["state"]) + HELD_SIZES * len(sizes))
        for dims in sizes:
            n += HELD_DIM * len(dims)
    return n


def digest_of(item: Mapping[str, Any]) -> Digest:
    """The digest of a frame in wire form (see :data:`Group`). A group listed twice: the
    later wins; entries of a group the frame does not list are not part of any verdict."""
    groups: Digest = {}
    for g in item["groups"]:
        groups[g["pg"]] = [g["last_enqueued"], g["last_completed"], g["desc"], g["size"], {},
                           None, {}]
    tops: Dict[str, int] = {}
    for e in item["entries"]:
        group = groups.get(e["pg"])
        if group is None:
            continue
        seq = e["seq"]
        group[4][seq] = e
        top = tops.get(e["pg"])
        if top is None or seq >= top:
            tops[e["pg"]] = seq
            group[5] = e["op"]
    for group in groups.values():
        if group[5] is None:
            group[5] = ""
    return groups


def _check_wire(item: Any) -> Dict[str, Any]:
    """``item`` if it has the wire form's shape (a web reads it from the feed), else
    ValueError. Values inside are the broker's, decoded from a validated frame."""
    if (not isinstance(item, dict) or type(item.get("rank")) is not int
            or item.get("reason") not in ("stall", "request")
            or not isinstance(item.get("request_id"), str)
            or not isinstance(item.get("groups"), list)
            or not isinstance(item.get("entries"), list)):
        raise ValueError("not a collectives frame in wire form")
    return item


def pg_order(pg: str) -> Tuple[int, int, str]:
    """Sort key of a group id: numeric ids in numeric order first, then the others."""
    number = ascii_int(pg, 18)  # (not str.isdigit: "²" is a digit int() refuses)
    return (1, 0, pg) if number is None else (0, number, "")


def _majority(counts: Dict[Any, int]) -> Any:
    """The most common key; ties: the first counted (the caller counts by ascending rank)."""
    best, n = None, 0
    for key, count in counts.items():
        if count > n:
            best, n = key, count
    return best


def collective_verdict(current: Mapping[int, Digest],
                       world_size: Optional[int]) -> List[Dict[str, Any]]:
    """The run's collective verdict (section 7.2) over ``current``: rank -> the digest of its
    current frame. Returns the listed groups, by ``pg`` (numeric order where numeric), each
    ``{pg, desc, size, seq, op, waiting, behind, absent, mismatched}``."""
    members: Dict[str, List[Tuple[int, Group]]] = {}
    tops: Dict[str, int] = {}  # pg -> the largest last_enqueued (the group's seq)
    for rank in sorted(current):
        for pg, group in current[rank].items():
            found = members.get(pg)
            if found is None:
                members[pg] = [(rank, group)]
                tops[pg] = group[0]
            else:
                found.append((rank, group))
                if group[0] > tops[pg]:
                    tops[pg] = group[0]
    out: List[Dict[str, Any]] = []
    for pg in sorted(members, key=pg_order):
        ranks = members[pg]
        seq = tops[pg]
        ops: Dict[str, int] = {}
        pairs: Dict[Tuple[str, Any], int] = {}
        at_seq: List[Tuple[int, Any, Any]] = []
        waiting: List[int] = []
        behind: List[Dict[str, Any]] = []
        op_get, pair_get, at_add, wait_add = ops.get, pairs.get, at_seq.append, waiting.append
        for rank, group in ranks:
            entry = group[4].get(seq)
            if entry is not None:
                op = entry["op"]
                # (the sizes as a key only here: one entry a rank, not 64 a frame)
                keys = group[6]
                pair = keys.get(seq)
                if pair is None:
                    pair = keys[seq] = (op, tuple(map(tuple, entry["input_sizes"])))
                at_add((rank, pair, entry))
                ops[op] = op_get(op, 0) + 1
                pairs[pair] = pair_get(pair, 0) + 1
            enqueued = group[0]
            if enqueued < seq:
                behind.append({"rank": rank, "last_enqueued": enqueued, "op": group[5]})
            elif group[1] < seq:
                wait_add(rank)
        major = _majority(pairs)
        mismatched = [{"rank": rank, "op": entry["op"], "input_sizes": entry["input_sizes"]}
                      for rank, pair, entry in at_seq if pair != major]
        absent: List[int] = []
        if pg == "0" and world_size is not None:
            absent = [r for r in range(world_size) if r not in current]
        if not (waiting or behind or absent or mismatched):
            continue
        first = ranks[0][1]
        out.append({"pg": pg, "desc": first[2], "size": first[3], "seq": seq,
                    "op": _majority(ops) or "", "waiting": waiting, "behind": behind,
                    "absent": absent, "mismatched": mismatched})
    return out


def behind_message(group: Mapping[str, Any]) -> str:
    """The ``collective_behind`` alert's message for a rank behind in ``group``."""
    return (f"not in {group['op']} #{group['seq']} of group {group['pg']} "
            f"where {len(group['waiting'])} ranks wait")


def mismatch_message(group: Mapping[str, Any], entry: Mapping[str, Any]) -> str:
    """The ``collective_mismatch`` alert's message for ``entry`` of ``group``'s mismatched."""
    return (f"{group['op']} #{group['seq']} of group {group['pg']} differs: "
            f"{entry['op']} {json.dumps(entry['input_sizes'])}")


def verdict_alerts(before: Iterable[Mapping[str, Any]],
                   after: Iterable[Mapping[str, Any]]) -> List[Tuple[str, int, str]]:
    """``(kind, rank, message)`` for each alert ``after`` raises over ``before``: a rank in a
    listed group's ``behind``/``mismatched`` that was not there before, or every such rank
    of a group whose ``seq`` changed (or that was not listed)."""
    old = {g["pg"]: g for g in before}
    raised: List[Tuple[str, int, str]] = []
    for group in after:
        prev = old.get(group["pg"])
        fresh = prev is None or prev["seq"] != group["seq"]
        was_behind = set() if fresh else {b["rank"] for b in prev["behind"]}  # type: ignore[index]
        was_mismatched = set() if fresh else {m["rank"] for m in prev["mismatched"]}  # type: ignore[index]
        for b in group["behind"]:
            if b["rank"] not in was_behind:
                raised.append(("collective_behind", b["rank"], behind_message(group)))
        for m in group["mismatched"]:
            if m["rank"] not in was_mismatched:
                raised.append(("collective_mismatch", m["rank"], mismatch_message(group, m)))
    return raised


class RunCollectives:
    """The latest ``collectives`` frame per (rank, reason) of one run, with digests, and
    which is each rank's latest of either reason (the one a verdict reads)."""

    def __init__(self, cap: int = MAX_RUN_COLLECTIVES_BYTES,
                 budget: _budget.ByteBudget | None = None) -> None:
        self.cap = cap
        #: the process's byte budget (every run's store shares it, and the dumps')
        self.budget = budget if budget is not None else _budget.PROCESS_BUDGET
        #: frames dropped because the budget was full (oldest first, of any run)
        self.over_budget = 0
        #: (rank, reason) dropped by the budget and not yet taken (:meth:`take_gone`)
        self._gone: Dict[Tuple[int, str], None] = {}
        #: (rank, reason) -> [wire dict, digest, bytes counted]
        self._frames: Dict[Tuple[int, str], List[Any]] = {}
        #: rank -> the reason of its latest frame (of either reason)
        self.latest: Dict[int, str] = {}
        #: bytes counted against the cap now
        self.bytes = 0
        #: frames not kept because the cap bit (since this store was made)
        self.over_cap = 0

    def __len__(self) -> int:
        return len(self._frames)

    def __contains__(self, key: object) -> bool:
        return key in self._frames

    def put(self, frame: Collectives) -> bool:
        """Keep ``frame`` as its rank's latest of its reason (and of either); False when
        the cap bit (then the rank has no frame of that reason)."""
        return self.put_wire(wire_of(frame), frame.run)

    def put_wire(self, item: Any, run: str = "") -> bool:
        """:meth:`put` of a frame in wire form (ValueError if it is not one)."""
        item = _check_wire(item)
        key = (item["rank"], item["reason"])
        self.remove(key)
        try:
            digest = digest_of(item)
        except (KeyError, TypeError, ValueError):
            raise ValueError("not a collectives frame in wire form") from None
        cost = held_bytes(item)
        if self.bytes + cost > self.cap:
            self.over_cap += 1
            _rlog.warning("collectives_cap", "run %s: a collectives frame of rank %d not kept: "
                          "the run's hold %d bytes, the cap is %d (%d not kept so far)", run,
                          key[0], self.bytes, self.cap, self.over_cap)
            return False
        self.bytes += cost
        self._frames[key] = [item, digest, cost]
        self.latest[key[0]] = key[1]
        self._gone.pop(key, None)
        self.budget.charge(self, key, cost)  # may drop older frames or dumps, of any run
        return True

    def remove(self, key: Tuple[int, str]) -> None:
        """Forget the frame of ``key`` = (rank, reason), if any."""
        old = self._frames.pop(key, None)
        if old is None:
            return
        self.bytes -= old[2]
        self.budget.forget(self, key)
        self.budget.adjust(-old[2])
        rank = key[0]
        if self.latest.get(rank) == key[1]:
            other = (rank, "request" if key[1] == "stall" else "stall")
            if other in self._frames:
                self.latest[rank] = other[1]
            else:
                del self.latest[rank]

    def evict(self, key: Any) -> None:
        """The process's byte budget is full and this is its oldest frame: drop it."""
        if key in self._frames:
            self.remove(key)
            self.over_budget += 1
            self._gone[key] = None

    def take_gone(self) -> List[Tuple[int, str]]:
        """The (rank, reason) the budget dropped since the last call (the sink tells the web
        and recomputes the verdict)."""
        gone, self._gone = list(self._gone), {}
        return gone

    @property
    def has_gone(self) -> bool:
        """Whether the budget dropped a frame that :meth:`take_gone` has not returned."""
        return bool(self._gone)

    def close(self) -> None:
        """Forget every frame (the run left memory): their bytes go back to the budget."""
        for key in list(self._frames):
            self.remove(key)
        self._gone = {}

    def discard(self, rank: int) -> None:
        """Forget ``rank``'s frames."""
        self.remove((rank, "stall"))
        self.remove((rank, "request"))

    def wire(self, keys: Optional[Iterable[Tuple[int, str]]] = None) -> List[Dict[str, Any]]:
        """The kept frames (of ``keys`` only, when given) in wire form, by rank then reason."""
        chosen = sorted(self._frames) if keys is None else sorted(k for k in keys
                                                                   if k in self._frames)
        return [self._frames[k][0] for k in chosen]

    def digests(self, ranks: Iterable[int]) -> Dict[int, Digest]:
        """rank -> the digest of its latest frame, for each of ``ranks`` that has one."""
        out: Dict[int, Digest] = {}
        frames, latest = self._frames, self.latest
        for rank in ranks:
            reason = latest.get(rank)
            if reason is not None:
                out[rank] = frames[(rank, reason)][1]
        return out

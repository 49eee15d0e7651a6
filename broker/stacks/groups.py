"""Grouping of stack dumps across ranks (PROTOCOL.md section 2.5 "Grouping", section 4
``GET /api/runs/<run>/stacks``): how one reads a hang across a thousand ranks.

Pure: dumps in, JSON-ready groups out, no I/O and no clock. A dump is either a decoded
``rank_agent.protocol.Stacks`` frame or its dict form (the same keys, as the journal and the
feed carry it); both are read without conversion.

* **Which dumps**: the ``stall`` dumps of the ranks stalled now and the ``request`` answers
  to the run's latest request (:func:`stack_groups` selects them; :func:`group_dumps`
  groups whatever it is given). Profiles are not grouped: an answer with no threads (a
  profile) is left out, and so is a dump with no threads at all.
* **The key**: the reason, the request id and the ``main`` thread's list of ``(file, line,
  function)`` (a dump without a ``main`` thread uses its first thread). A group therefore
  carries one ``reason`` and ``request_id``, as section 4's group object has one; a rank that
  is stalled and also answered the latest request is in one group of each.
* **Order**: largest group first; equal sizes by lowest rank.
* **Output**: ``{"reason", "request_id", "frames", "ranks"}``; ``frames`` is the shared
  stack as ``[{file, line, function, code}]``, outermost first as in the dump (section 4;
  the page shows it innermost first), with the source lines of the group's lowest rank;
  ``ranks`` sorted.

Cost: one C-level key per dump (``map`` over an ``itemgetter``/``attrgetter``) and a dict
lookup, so 1,024 ranks with 60-frame dumps group in a few milliseconds
(``bench/stacks_bench.py``, ``stacks_groups_1024_ms``).
"""
from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any, Collection, Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = ["group_dumps", "stack_groups", "main_frames"]

_key_of_dict = itemgetter("file", "line", "function")
_key_of_struct = attrgetter("file", "line", "function")


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def main_frames(dump: Any) -> Optional[List[Any]]:
    """The frames of the dump's ``main`` thread, else of its first thread; None when the
    dump has no thread (a profile answer)."""
    threads = _get(dump, "threads") or ()
    if not threads:
        return None
    for thread in threads:
        if _get(thread, "main", False):
            return _get(thread, "frames") or []
    return _get(threads[0], "frames") or []


def _frame_json(frame: Any) -> Dict[str, Any]:
    if isinstance(frame, dict):
        return {"file": frame.get("file", ""), "line": frame.get("line", 0),
                "function": frame.get("function", ""), "code": frame.get("code", "")}
    return {"file": frame.file, "line": frame.line, "function": frame.function,
            "code": frame.code}


def group_dumps(dumps: Iterable[Tuple[int, Any]]) -> List[Dict[str, Any]]:
    """Group ``(rank, dump)`` pairs as the module docstring says."""
    groups: Dict[Tuple[Any, ...], List[Any]] = {}
    for rank, dump in dumps:
        frames = main_frames(dump)
        if frames is None:
            continue
        if frames and isinstance(frames[0], dict):
            stack = tuple(map(_key_of_dict, frames))
        else:
            stack = tuple(map(_key_of_struct, frames))
        reason = _get(dump, "reason", "")
        request_id = _get(dump, "request_id", "") or ""
        key = (reason, request_id, stack)
        entry = groups.get(key)
        if entry is None:
            groups[key] = [rank, [rank], frames, reason, request_id]
        else:
            entry[1].append(rank)
            if rank < entry[0]:
                entry[0], entry[2] = rank, frames
    ordered = sorted(groups.values(), key=lambda e: (-len(e[1]), e[0]))
    return [{"reason": reason, "request_id": request_id,
             "frames": [_frame_json(f) for f in frames], "ranks": sorted(ranks)}
            for _, ranks, frames, reason, request_id in ordered]


def stack_groups(stall_dumps: Mapping[int, Any], stalled: Collection[int],
                 request_dumps: Mapping[int, Any],
                 latest_request_id: Optional[str]) -> List[Dict[str, Any]]:
    """The groups of ``GET /stacks``: each rank's latest ``stall`` dump (``stall_dumps``)
    if the rank is stalled now, and each rank's latest ``request`` answer
    (``request_dumps``) if it answers ``latest_request_id`` (none when that is None)."""
    chosen: List[Tuple[int, Any]] = [(r, d) for r, d in stall_dumps.items() if r in stalled]
    if latest_request_id is not None:
        chosen.extend((r, d) for r, d in request_dumps.items()
                      if (_get(d, "request_id", "") or "") == latest_request_id)
    return group_dumps(chosen)

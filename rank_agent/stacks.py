"""Python stack dumps and the sampling profile counter (PROTOCOL.md sections 2 and 2.5).

Everything here runs on an agent thread (the stall watch's or the control channel's), never
on the training thread: a dump reads ``sys._current_frames()`` (a snapshot of every thread's
innermost frame, taken under the GIL) and walks each frame chain; source lines come from
:mod:`linecache`, which may read a file the first time it sees it, and that read happens
here, on the agent's thread.

**Truncation** (section 2.5), so that a dump never produces a frame the broker rejects: the
training thread first, at most 128 threads, each thread's innermost 256 frames, every
string cut at 512 characters, and further threads left out once the encoded frame would
pass 4 MiB (each thread is encoded once to learn its size; the budget keeps a margin for
the frame's own fields). A profile keeps at most 2,000 distinct stacks while it runs (when
full, the lightest quarter is evicted: a profile is read for its heaviest stacks, and
``samples`` still counts every sample) and each stack is cut to its innermost 256 entries.

The module imports only the standard library and :mod:`rank_agent.protocol` (msgspec).
"""
from __future__ import annotations

import linecache
import sys
import threading
import time
from types import FrameType
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, TypeVar

from .protocol import (
    MAX_FRAME_BYTES,
    MAX_PROFILE_DEPTH,
    MAX_PROFILE_ENTRIES,
    MAX_STACK_FRAMES,
    MAX_STACK_TEXT,
    MAX_STACK_THREADS,
    ProfileEntry,
    StackFrame,
    Stacks,
    ThreadStack,
    encoder,
)

__all__ = [
    "FRAME_BUDGET",
    "ProfileCounter",
    "collect_threads",
    "dump_threads",
    "fit_threads",
    "fit_profile",
    "stacks_frame",
    "main_thread_ident",
]

#: Bytes of encoded threads a dump may hold: the 4 MiB frame limit less a margin for the
#: frame's other fields (run, rank, reason, request_id, numbers: well under 1 KiB) and the
#: list headers.
FRAME_BUDGET = MAX_FRAME_BYTES - 4096

#: A profile key: the sampled stack innermost first, as (file, function, line) triples.
StackKey = Tuple[Tuple[str, str, int], ...]

_encode = encoder.encode


def _cut(text: str) -> str:
    return text if len(text) <= MAX_STACK_TEXT else text[:MAX_STACK_TEXT]


def main_thread_ident() -> Optional[int]:
    """The process's main thread (the ``main`` thread before any ``log_step``/``log_epoch``)."""
    return threading.main_thread().ident


def _frames_of(frame: Optional[FrameType], source: bool) -> List[StackFrame]:
    """A thread's innermost :data:`MAX_STACK_FRAMES` frames, outermost first."""
    inner: List[StackFrame] = []
    while frame is not None and len(inner) < MAX_STACK_FRAMES:
        code = frame.f_code
        filename = code.co_filename
        line = frame.f_lineno or 0
        text = linecache.getline(filename, line).strip() if source and line > 0 else ""
        inner.append(StackFrame(file=_cut(filename), line=line, function=_cut(code.co_name),
                                code=_cut(text)))
        frame = frame.f_back
    inner.reverse()
    return inner


def collect_threads(frames: Mapping[int, FrameType], names: Mapping[int, str],
                    main_ident: Optional[int], *, source: bool = True) -> List[ThreadStack]:
    """Every thread of ``frames`` (ident -> innermost frame) as a :class:`ThreadStack`: the
    ``main_ident`` thread first and marked ``main``, the others in ident order, at most
    :data:`MAX_STACK_THREADS`, each with its innermost :data:`MAX_STACK_FRAMES` frames and
    strings cut at :data:`MAX_STACK_TEXT` characters. A thread ``threading`` does not know
    (made by C code) is named ``Thread-<ident>``."""
    order = sorted(frames)
    if main_ident in frames:
        order.remove(main_ident)  # type: ignore[arg-type]
        order.insert(0, main_ident)  # type: ignore[arg-type]
    out: List[ThreadStack] = []
    for ident in order[:MAX_STACK_THREADS]:
        name = names.get(ident) or f"Thread-{ident}"
        out.append(ThreadStack(name=_cut(name), frames=_frames_of(frames[ident], source),
                               main=ident == main_ident))
    return out


#: what :func:`_fit_leading` cuts: threads or profile entries
_Fit = TypeVar("_Fit", ThreadStack, ProfileEntry)


def _fit_leading(items: Iterable[_Fit], budget: int) -> List[_Fit]:
    """The leading ``items`` whose encoded sizes together fit ``budget`` bytes: the first
    one that would pass it, and everything after, is left out (the order is the priority)."""
    kept: List[_Fit] = []
    used = 0
    for item in items:
        size = len(_encode(item))
        if used + size > budget:
            break
        kept.append(item)
        used += size
    return kept


def fit_threads(threads: Iterable[ThreadStack], budget: int = FRAME_BUDGET) -> List[ThreadStack]:
    """The leading threads whose encoded size fits ``budget`` bytes (the first thread is
    the training thread: it is kept whenever it fits; the others are left out from the
    first that would pass the budget on, so the frame stays under 4 MiB)."""
    return _fit_leading(threads, budget)


def fit_profile(entries: Iterable[ProfileEntry], budget: int = FRAME_BUDGET) -> List[ProfileEntry]:
    """The leading (heaviest) profile entries whose encoded size fits ``budget`` bytes: 2,000
    stacks of 256 long entries would pass 4 MiB, and the heaviest are the ones worth sending."""
    return _fit_leading(entries, budget)


def dump_threads(main_ident: Optional[int], *, source: bool = True) -> List[ThreadStack]:
    """Every thread of this process, truncated as section 2.5 says (see module docstring).
    ``main_ident`` (the training thread) is marked ``main`` and comes first."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    try:
        return fit_threads(collect_threads(frames, names, main_ident, source=source))
    finally:
        del frames  # frames hold their locals: let them go now, not at the next collection


def stacks_frame(run: str, rank: int, reason: str, *, main_ident: Optional[int],
                 idle_s: float = 0.0, request_id: str = "") -> Stacks:
    """A ``stacks`` frame holding a dump of every thread, taken now."""
    return Stacks(run=run, rank=rank, reason=reason,  # type: ignore[arg-type]
                  taken_at=time.time(), request_id=request_id, idle_s=max(0.0, idle_s),
                  threads=dump_threads(main_ident))


def _stack_key(frame: Optional[FrameType]) -> StackKey:
    """The sampled stack, innermost first, cut to :data:`MAX_PROFILE_DEPTH` entries."""
    key: List[Tuple[str, str, int]] = []
    append = key.append
    while frame is not None and len(key) < MAX_PROFILE_DEPTH:
        code = frame.f_code
        append((code.co_filename, code.co_name, frame.f_lineno or 0))
        frame = frame.f_back
    return tuple(key)


class ProfileCounter:
    """Samples one thread's stack and counts each distinct stack (section 2.5's profile).

    Bounded while it runs: at most ``capacity`` distinct stacks are held; a new stack when
    full first evicts the lightest quarter (ties: the oldest), so one eviction pass (a sort)
    happens per ``capacity / 4`` new stacks, not per sample. :attr:`samples` counts every
    sample, evicted or not. A sample costs one ``sys._current_frames()`` snapshot and a walk
    of the sampled thread's frames; strings are built only by :meth:`entries`, once.
    """

    def __init__(self, capacity: int = MAX_PROFILE_ENTRIES) -> None:
        self.capacity = capacity
        self.samples = 0
        self.counts: Dict[StackKey, int] = {}

    def sample(self, ident: Optional[int]) -> bool:
        """Count the current stack of thread ``ident``; False if it has none (gone, or None)."""
        self.samples += 1
        if ident is None:
            return False
        frame = sys._current_frames().get(ident)
        if frame is None:
            return False
        self.add(_stack_key(frame))
        return True

    def add(self, key: StackKey, count: int = 1) -> None:
        """Count ``key`` (innermost first) ``count`` more times, evicting when full."""
        counts = self.counts
        if key in counts:
            counts[key] += count
            return
        if len(counts) >= self.capacity:
            keep = self.capacity - max(1, self.capacity // 4)
            heaviest = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:keep]
            self.counts = counts = dict(heaviest)
        counts[key] = count

    def entries(self) -> List[ProfileEntry]:
        """The counted stacks, heaviest first, as wire entries (outermost first)."""
        out: List[ProfileEntry] = []
        for key, count in sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True):
            stack = [f"{_cut(function)} ({_cut(filename)}:{line})"
                     for filename, function, line in reversed(key)]
            out.append(ProfileEntry(stack=stack, count=count))
        return out

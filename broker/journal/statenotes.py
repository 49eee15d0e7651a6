"""When the journal writes a run's STATE entries (PROTOCOL.md 8.5: what a run leaves behind).

The journal rebuilds a run by replaying its frames (``broker/journal/replay.py``), but some
of a run's state does not follow from them: alerts raised by the clock (``stale``), by GPU
samples the journal coalesced away, or by the collective verdict, which only current frames
form; the counters the GPU rules compare with; the header's ``collectives_last``; the
ranks' step figures (``steps`` frames are not journaled). Each is a *part* of a STATE entry
(``broker/journal/codec.py``): the part's whole value, written when it changed, so a replay
takes the last one of each part and needs nothing before it.

When: a part whose version moved (``RunSink.state_marks``, ``RunSink.figures_mark``, asked
after each event of the run) is written at once if its last entry is older than its interval,
else when the interval ends (at a later flush; the server flushes at every tick while one
waits), or when the run leaves memory or the journal closes:

* ``alerts`` (a new alert, a new message, one leaving the list), ``gpu`` (an XID, ECC or
  NVLink counter moved), ``collectives_last``: :data:`STATE_INTERVAL` (1 s). A stall storm
  changes the alert list with every frame; one entry a second is bounded by the list's cap
  (``broker/run/alerts.py``: 13.7 KB for 100 ``stalled`` alerts, 447 KB for eight kinds at
  their cap with 512-character messages) and the verdict's (``broker/run/collectivelast.py``).
* ``alerts`` whose only change is the time an alert was last raised: :data:`AT_INTERVAL`
  (60 s). A condition that persists is raised again with every sample (a GPU throttling):
  written each second it would grow the file by the list every second, for as long as the
  condition lasts.
* ``figures``: :data:`FIGURES_INTERVAL` (10 s); they move with every ``steps`` frame
  (~40 bytes a rank an entry).

A SIGKILL loses at most an interval of these changes, as it loses the frames since the
last flush.

Pure bookkeeping plus encoding: the journal owns the buffers and the files.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import msgspec

from broker.journal.codec import KIND_STATE, STATE_PART_BYTES, entry

if TYPE_CHECKING:
    from broker.run.sink import RunSink

__all__ = ["StateNotes", "FIGURES_INTERVAL", "state_entry"]

#: Seconds between two entries of the alert list, GPU counters or verdict of one run at most.
STATE_INTERVAL = 1.0
#: Seconds between two entries of an alert list whose only change is when alerts were raised.
AT_INTERVAL = 60.0
#: Seconds between two ``figures`` entries of one run at most.
FIGURES_INTERVAL = 10.0
_encoder = msgspec.msgpack.Encoder()
#: the parts ``RunSink.state_marks`` gives the versions of, in its order (the fourth: the
#: alert list's times)
_MARKED = ("alerts", "gpu", "collectives_last")


def state_entry(part: str, data: Any) -> bytes:
    """A whole STATE entry holding ``data`` as ``part``."""
    return entry(bytes((KIND_STATE, STATE_PART_BYTES[part])), _encoder.encode(data))


class StateNotes:
    """What one run's journal holds of its STATE parts, and when the next may be written."""

    __slots__ = ("marks", "figures", "marks_at", "alerts_at", "figures_at", "clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.marks: Optional[Tuple[int, ...]] = None  # sink.state_marks() as last written
        self.figures: Optional[Tuple[int, int, int]] = None  # sink.figures_mark() last written
        self.marks_at = -math.inf  # clock() when a marked part was last written
        self.alerts_at = -math.inf  # clock() when the alert list was last written
        self.figures_at = -math.inf  # clock() when the figures were last written
        self.clock = clock

    def loaded(self, sink: RunSink) -> None:
        """The sink was rebuilt from this file: what it holds is written already."""
        self.marks = sink.state_marks()
        self.figures = sink.figures_mark()

    def note(self, buf: bytearray, sink: RunSink, force: bool = False) -> bool:
        """Append the parts that changed and may be written now (every changed one when
        ``force``); returns True when some changed part must wait (ask again later)."""
        marks = sink.state_marks()
        figures = sink.figures_mark()
        old = self.marks
        if marks == old and figures == self.figures:
            return False  # (the common case: asked after every event, nothing to write)
        now = self.clock()
        waiting = False
        if marks != old:
            if old is None or marks[:3] != old[:3]:  # more than the alerts' times
                due = now - self.marks_at >= STATE_INTERVAL
            else:
                due = now - self.alerts_at >= AT_INTERVAL
            if force or due:
                for i, part in enumerate(_MARKED):
                    if old is None or marks[i] != old[i] or (i == 0 and marks[3] != old[3]):
                        buf += state_entry(part, sink.saved_state(part))
                        if i == 0:
                            self.alerts_at = now
                self.marks, self.marks_at = marks, now
            else:
                waiting = True
        if figures != self.figures:
            if force or now - self.figures_at >= FIGURES_INTERVAL:
                buf += state_entry("figures", sink.saved_state("figures"))
                self.figures, self.figures_at = figures, now
            else:
                waiting = True
        return waiting

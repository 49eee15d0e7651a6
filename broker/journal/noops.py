"""Which accepted frames the journal can leave out because they changed nothing.

PROTOCOL 2 ("Limits"): the journal keeps no frame that changed nothing. The sink's rules
(section 2's table) make some repeats no-ops by construction, and this filter knows them
from the frames alone, without asking the sink:

* ``metadata``: last write wins, so the same JSON text as the last one kept changes nothing;
* ``svg``: first non-empty arrival wins, so every ``svg`` after that one changes nothing,
  and so does an empty one once the run has started (it does not latch);
* ``hardware``: per-rank last write, so the rank's last summary again changes nothing;
* ``register``: the rank's last register again (same known fields) changes nothing, unless
  the rank finished since (a register reactivates a finished rank);
* ``finish``: a finished rank's repeat is a no-op (the first one decided its status).

What such a frame still does is liveness: the rank is seen and the run's ``updated_at`` moves.
Neither is journaled state (a rebuilt run takes liveness from the reload time), so after a
restart ``updated_at`` is the last *kept* frame's time. The filter is primed by the replay at
start, so it knows what the file already holds.
"""
from __future__ import annotations

from rank_agent import protocol
from rank_agent.protocol import Finish, Frame, Hardware, Metadata, Register, Svg

__all__ = ["Unchanged"]


class Unchanged:
    """What one run's journal already holds of the frames whose repeats are no-ops."""

    __slots__ = ("metadata", "svg_latched", "hardware", "registers", "finished")

    def __init__(self) -> None:
        self.metadata: str | None = None
        self.svg_latched = False
        self.hardware: dict[int, str] = {}
        self.registers: dict[int, bytes] = {}  # rank -> its last register's known fields
        self.finished: set[int] = set()

    def keep(self, frame: Frame, started: bool) -> bool:
        """Note ``frame`` (accepted by the sink) and say whether it changed anything, i.e.
        must be journaled. ``started``: the journal already holds a frame of the run (the
        first frame is always kept: it carries ``started_at``)."""
        tp = type(frame)
        if tp is Metadata:
            text = frame.json  # type: ignore[union-attr]
            if started and text == self.metadata:
                return False
            self.metadata = text
        elif tp is Svg:
            svg = frame.svg  # type: ignore[union-attr]
            if started and (self.svg_latched or not svg):
                return False
            if svg:
                self.svg_latched = True
        elif tp is Hardware:
            summary = frame.summary  # type: ignore[union-attr]
            if started and self.hardware.get(frame.rank) == summary:
                return False
            self.hardware[frame.rank] = summary
        elif tp is Register:
            known = protocol.encoder.encode(frame)
            if started and self.registers.get(frame.rank) == known:
                return False
            self.registers[frame.rank] = known
            self.finished.discard(frame.rank)
        elif tp is Finish:
            if frame.rank in self.finished:
                return False
            self.finished.add(frame.rank)
            self.registers.pop(frame.rank, None)  # a register after this one reactivates
        return True

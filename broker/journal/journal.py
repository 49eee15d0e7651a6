"""The broker's journal: one append-only file per run, replayed into fresh sinks at start.

PROTOCOL.md section 6 ("Persistence") asks that a broker restarted on the same data dir,
even after SIGKILL, serves the same records, keeps every run's state and issues event ids
above any it issued before. The sink is pure and deterministic, so the journal does not
store state: it stores what the sink was fed (accepted frames that changed something, as
their known fields, with their receive time) and rebuilds the state by feeding the same
frames to a fresh :class:`~broker.run.sink.RunSink`. Besides frames it stores sequence numbers, which the sink
cannot recompute (ticks are not replayed): a reservation ``seq_hi`` that every issued id
stays below, and the id of each closed epoch record, so that a web client's
``Last-Event-ID`` keeps meaning the same record across a broker restart.

File layout (``<data_dir>``)::

    VERSION               "rankboard-journal 1\\n": the format of everything below
    LOCK                  flock()ed while a broker holds the dir (one broker per dir)
    runs/<run>.journal    HEADER, then entries

Entries and their kinds are in ``broker/journal/codec.py``; the replay that rebuilds a run
from them is ``broker/journal/replay.py``; the dir's lock, version and setting files aside
are ``broker/journal/datadir.py``; open files and their descriptors are
``broker/journal/writer.py``. This module decides what is written when (buffering,
coalescing, ids, STEPS blocks) and what to do with each file at start.

``steps`` frames are *not* journaled (a run whose first frame is one gets an empty
``svg`` frame of that rank in its place, which carries the run's ``started_at``): the
closed steps they produce are, in compact columnar blocks (kind 5)
written when their ``steps`` event is, so a restart loads a million-step run with a few
``np.frombuffer`` calls instead of replaying every rank's points. The price, documented in
docs/DESIGN.md: points of steps that had not closed (or closed but not yet been published)
at a SIGKILL are lost, as are the ranks' ``step``/``step_ms`` until they report again.

An entry that is short, over :data:`MAX_ENTRY` or fails its CRC, with good entries after
it (damage in the middle, PROTOCOL 6), costs only its bytes: they are moved to
``<run>.journal.damaged-<time>`` beside the journal, the journal is rewritten without them
and every good entry is replayed. With no good entry after it (a torn write at SIGKILL, or
garbage at the end) the reader warns once for the file and truncates the file there so
later appends stay readable.

``resources`` frames are coalesced: the latest one per rank is held in memory and written
only right before the next non-``resources`` frame of the run (the frames that can close an
epoch or change what a rank is), so replay applies every sample an epoch close saw, in the
same order relative to everything that matters, and the file grows with ranks x epochs, not
with the sampling rate. The run's very first frame is always written (it is the run's
``started_at``, which ``elapsed_secs`` counts from). What is lost at a SIGKILL is at most the
samples newer than a rank's last epoch, and the frames since the last :meth:`Journal.flush`.

Buffers are written once per batch (:meth:`Journal.flush`), or at once when all runs'
buffers together pass :data:`WRITE_BUFFER_BYTES` (PROTOCOL 2: bounded in bytes; counted in
``counters()["early_flushes"]``). STEPS blocks are built from the series the run's
``steps`` frames named since the last block (``broker/journal/stepblocks.py``), so a block costs
what it holds, not the run's series count.

Not thread-safe: the broker's single I/O loop owns it.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from operator import itemgetter
from typing import Iterable, Union

from broker.journal import writer as _writer
from broker.journal.codec import (
    ENTRY_HEAD,
    FORMAT_VERSION,
    HEADER,
    HEADER_PREFIX,
    KIND_COMPLETE_SEQ,
    KIND_RECORD_SEQ,
    KIND_SEQ_HI,
    KIND_STEPS,
    MAX_ENTRY,
    RECORD_SEQ,
    SEQ,
    STEP_BLOCK_BYTES,
    append_frame,
    block_encoder,
    entry,
    read_entries,
    scan_entries,
)
from broker.journal.datadir import (
    JournalError,
    check_version,
    cut_damage,
    remove,
    set_aside,
    take_lock,
)
from broker.journal.replay import replay
from broker.journal.seqfloor import SeqFloor
from broker.journal.stepblocks import wire_block
from broker.journal.writer import Handles, RunFile
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import Frame, Metrics, Resources, Stacks, Steps, Svg, valid_run_id

__all__ = ["Journal", "JournalError", "FORMAT_VERSION", "HEADER", "MAX_ENTRY", "WRITE_BUFFER_BYTES",
           "read_entries"]

log = logging.getLogger(__name__)

_SUFFIX = ".journal"
#: Bytes the journal holds for writing, over all runs, before it writes them out at once
#: instead of at the end of the batch (PROTOCOL 2: the journal's write buffer is bounded in
#: bytes). Counted in :attr:`Journal.early_flushes` each time it bites.
WRITE_BUFFER_BYTES = 16 * 1024 * 1024
#: Bytes of ``stacks`` frames one run's journal file holds at most (section 2.5 dumps are up
#: to 4 MiB each, and a long run stalls and is asked again and again): beyond it dumps are
#: kept in memory only (a restart lists the ones journaled before), counted in
#: ``counters()["stacks_unjournaled"]``.
MAX_STACKS_BYTES = 64 * 1024 * 1024
#: While writes fail (PROTOCOL 8.4: a full disk), they are retried at most this often
#: (seconds), not on every batch, unless WRITE_BUFFER_BYTES are waiting.
RETRY_S = 1.0
_time_of = itemgetter(0)  # the receive time of a held sample, ``(now, frame)``


class Journal:
    """Per-run append-only journals under ``data_dir``, and the rebuild of runs from them.

    The server calls :meth:`load` once at start, :meth:`accept` for every accepted frame
    (after ``sink.apply`` succeeded; :meth:`accept_samples` for a batch's held samples),
    :meth:`note_seq` after a tick's events, :meth:`flush` once per drained batch and
    :meth:`close` at exit. The constructor does no I/O.
    """

    def __init__(
        self,
        data_dir: Union[str, os.PathLike[str]],
        *,
        seq_block: int = 1000,
        retention_days: float | None = None,
        fsync_interval: float | None = None,
        max_open_files: int = 256,
    ) -> None:
        """``seq_block``: ids reserved at a time (a new block is taken when less than half
        of one is left, so up to ``seq_block // 2`` events per run may be issued between two
        flushes without breaking the restart guarantee). ``retention_days``: finished runs
        whose last frame is older are deleted at :meth:`load` (None keeps them).
        ``fsync_interval``: fsync written files at most this often (seconds) inside
        :meth:`flush`; None never does (SIGKILL needs no fsync, only power loss does;
        :meth:`close` always syncs). ``max_open_files``: least recently written handles
        beyond this are closed."""
        if seq_block < 2:
            raise ValueError("seq_block must be >= 2")
        if max_open_files < 1:
            raise ValueError("max_open_files must be >= 1")
        self.data_dir = os.fspath(data_dir)
        self.runs_dir = os.path.join(self.data_dir, "runs")
        self.seq_block = seq_block
        self.retention_days = retention_days
        self.fsync_interval = fsync_interval
        self.max_open_files = max_open_files
        self._files: dict[str, RunFile] = {}
        self._dirty: dict[str, RunFile] = {}
        self._handles = Handles(self.runs_dir, max_open_files=max_open_files,
                                fsync_interval=fsync_interval)
        self._lock_fd: int | None = None
        self._closed = False
        #: damaged ranges found in the middle of journals and set aside (PROTOCOL 6)
        self.damaged_entries = 0
        #: entries set aside at load because applying them raised (a bug, not damage)
        self.unreplayable_entries = 0
        #: bytes buffered since the last flush (over all runs), and the mark at which the
        #: buffers are written at once (WRITE_BUFFER_BYTES above what failed writes hold)
        self._buffered = 0
        self._flush_at = WRITE_BUFFER_BYTES
        #: times the write buffer reached WRITE_BUFFER_BYTES within a batch
        self.early_flushes = 0
        self.stacks_unjournaled = 0
        #: runs left on disk at load beyond ``max_runs`` (PROTOCOL 6)
        self.runs_not_loaded = 0
        self._visited_gone = 0  # step_series_visited of runs no longer held
        #: runs with a STATE part that changed too soon after its last entry
        #: (``broker/journal/statenotes.py``): written at a later flush, or when they go
        self._state_due: dict[str, tuple[RunFile, RunSink]] = {}
        #: finished runs deleted at :meth:`load` by ``retention_days`` (PROTOCOL 8.4 counts
        #: them in rankboard_runs_deleted_total{reason="days"})
        self.deleted_at_load = 0
        #: while writes fail, :meth:`flush` tries them again at most once per this many
        #: seconds (0: on every call; the server sets RETRY_S: a full disk is not retried
        #: on every batch of its receive loop, PROTOCOL 8.4)
        self.retry_interval = 0.0
        self._retry_at = 0.0
        #: ids issued while writes fail stay below what a restart starts from (SEQFLOOR)
        self._floor = SeqFloor(self.data_dir)
        self._floor_due = 0
        self._floor_all = False

    # -- start -------------------------------------------------------------------------

    def load(self, *, stale_after: float = 30.0, now: float | None = None,
             step_close_after: float = 10.0, max_runs: int | None = None) -> dict[str, RunSink]:
        """Rebuild the runs on disk: ``{run: sink}``, least recently active first, with each
        sink's ``seq`` above any id issued before, and a fresh reservation already written.

        ``max_runs`` (the broker's ``--max-runs``; None: no bound): only the runs whose
        journals were written to most recently (file mtime) are rebuilt, up to that many
        (PROTOCOL 6); the others stay on disk, where a new frame (:meth:`load_run`) or
        ``rankboard export`` reaches them, and are counted in ``runs_not_loaded``.

        Creates the dirs, takes the dir's lock (:class:`JournalError` if another broker
        holds it or the dir is of a newer format), deletes finished runs whose last frame is
        older than ``retention_days`` (``now`` defaults to the wall clock) among those it
        reads. Damage is handled as the module docstring says; a file that cannot be read is
        skipped with a warning. Never raises for a bad file.
        """
        if max_runs is not None and max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        os.makedirs(self.runs_dir, exist_ok=True)
        if self._lock_fd is None:
            self._lock_fd = take_lock(self.data_dir)
        self._check_writable()
        try:
            check_version(self.data_dir)
        except JournalError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise
        if self._floor._fd is None:
            self._floor.open()
        wall = time.time() if now is None else now
        horizon = None if self.retention_days is None else wall - self.retention_days * 86400.0
        sinks: dict[str, RunSink] = {}
        try:
            names = os.listdir(self.runs_dir)
        except OSError as exc:
            log.warning("journal: cannot list %s: %s; starting with no runs", self.runs_dir, exc)
            return sinks
        found: list[tuple[int, str]] = []  # (mtime, run)
        for name in names:
            if not name.endswith(_SUFFIX):
                continue
            run = name[: -len(_SUFFIX)]
            if not valid_run_id(run):
                log.warning("journal: ignoring %s (not a run id)", name)
                continue
            try:
                mtime = os.stat(os.path.join(self.runs_dir, name)).st_mtime_ns
            except OSError:
                mtime = 0  # (reading it will say what is wrong)
            found.append((mtime, run))
        found.sort(reverse=True)  # most recently written first; ties by name
        loaded: list[tuple[str, RunSink]] = []
        for i, (_, run) in enumerate(found):
            if max_runs is not None and len(loaded) >= max_runs:
                self.runs_not_loaded += len(found) - i
                log.info("journal: %d runs left on disk beyond --max-runs %d (the least "
                         "recently active; a new frame brings one back)", len(found) - i,
                         max_runs)
                break
            sink = self._load_guarded(run, stale_after, horizon, step_close_after, wall)
            if sink is not None:
                loaded.append((run, sink))
        for run, sink in reversed(loaded):  # least recently active first, as Runs keeps them
            sinks[run] = sink
        self.flush()
        log.info("journal: %d runs rebuilt from %s", len(sinks), self.runs_dir)
        return sinks

    def _check_writable(self) -> None:
        """Say at start, in one line, when run files cannot be written (a read-only
        ``runs/``): the broker still serves from memory, but nothing it accepts would
        survive a restart, and each write would otherwise only fail in the log, one run
        at a time. Counted as a write failure, so /metrics shows it from the start."""
        try:
            fd, path = tempfile.mkstemp(prefix=".probe-", dir=self.runs_dir)
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError as exc:
            self._handles.write_failures += 1
            self._handles.probe_failed = True
            log.error("journal: cannot write run files in %s (%s): runs are kept in memory "
                      "only until it is writable; counted as "
                      "rankboard_journal_total{kind=\"write_failures\"}", self.runs_dir,
                      exc.strerror or exc)

    def load_run(self, run: str, *, stale_after: float = 30.0,
                 step_close_after: float = 10.0) -> RunSink | None:
        """Rebuild one run from its file (e.g. one evicted from memory that is active again);
        None when it has no readable journal. The same seq guarantees as :meth:`load`."""
        if not valid_run_id(run):
            raise ValueError(f"not a run id: {run!r}")
        self.forget(run)
        sink = self._load_guarded(run, stale_after, None, step_close_after, time.time())
        if sink is not None:
            self.flush()  # the new reservation is on disk before any of its events go out
        return sink

    # -- the hot path ------------------------------------------------------------------

    def accept(self, sink: RunSink, raw: bytes | memoryview, frame: Frame, now: float) -> None:
        """Journal the frame the sink just applied, then note the sink's ``seq`` (buffers
        only): the broker's per-frame call (``Runs.recorder``). In the common case (a
        ``resources`` frame to hold, or a frame that issued no id) it is a few attribute
        checks and one dict store.

        What is journaled is the frame's known fields (the decoded Struct, encoded again),
        never ``raw``: unknown keys a sender added are ignored by the sink, so they are not
        kept either (PROTOCOL 2, "Limits"). A frame that changed nothing is not journaled
        at all (:mod:`broker.journal.noops`). ``raw`` stays in the signature for
        :data:`broker.runs.Recorder`."""
        st = self._files.get(sink.run)
        if st is None:
            st = self._new_state(sink.run)
        tp = type(frame)
        n = len(st.buf)
        if st.started and (tp is Resources or tp is Steps):
            if tp is Resources:
                st.pending[frame.rank] = (now, frame)  # type: ignore[assignment]
            # (a steps frame: its closed steps are journaled as STEPS blocks instead)
        else:
            self._record(st, frame, now)
        if sink.seq != st.noted_seq:
            self._note_seq(st, sink)
        if len(st.buf) != n:
            self._grew(len(st.buf) - n)

    def accept_samples(self, sink: RunSink, frames: list[Resources], now: float) -> None:
        """:meth:`accept` of a batch's held samples of one run in one call (issue 33)."""
        st = self._files.get(sink.run)
        if st is not None and st.started and sink.seq == st.noted_seq:
            st.pending.update([(frame.rank, (now, frame)) for frame in frames])
        else:
            for frame in frames:
                self.accept(sink, b"", frame, now)

    def _record(self, st: RunFile, frame: Frame, now: float) -> None:
        if type(frame) is Resources:
            if st.started:
                st.pending[frame.rank] = (now, frame)  # type: ignore[assignment]
                return
        elif type(frame) is Steps:
            if st.started:
                return  # its closed steps are journaled instead (STEPS blocks)
            # The run's first frame carries started_at; its points must not be replayed
            # (they would close again next to the STEPS blocks): an empty svg stands in (it
            # does not latch, so it changes nothing but the rank's liveness; an empty
            # sample would show as the rank's resources).
            frame = Svg(run=frame.run, rank=frame.rank, svg="")
        elif type(frame) is Stacks or type(frame) is protocol.Collectives:  # one budget (7.2)
            data = protocol.encoder.encode(frame)  # its known fields, as every frame
            if st.started and st.stacks_bytes + len(data) > MAX_STACKS_BYTES:
                self.stacks_unjournaled += 1
                return  # the run's budget for dumps is spent: kept in memory only
            st.stacks_bytes += len(data)
            self._write_pending(st)
            st.started = True
            append_frame(st.buf, now, data)
            st.buf_frames += 1
            self._dirty[st.run] = st
            return
        elif not st.unchanged.keep(frame, st.started):
            return  # a repeat that changed nothing (PROTOCOL 2: not journaled)
        elif st.pending:
            if type(frame) is Metrics and frame.resources is not None:  # type: ignore[union-attr]
                # The frame's own sample replaces the rank's held one as it is applied.
                st.pending.pop(frame.rank, None)
            self._write_pending(st)
        st.started = True
        append_frame(st.buf, now, protocol.encoder.encode(frame))
        st.buf_frames += 1
        self._dirty[st.run] = st

    def note_seq(self, sink: RunSink) -> None:
        """Journal the run's sequence bookkeeping after its events were published: the ids
        of newly closed records and of a completion, and a new reservation when ``sink.seq``
        is within half a block of the last one. Nothing to do (one comparison) while
        ``sink.seq`` is what it was at the last call."""
        st = self._files.get(sink.run)
        if st is None:
            st = self._new_state(sink.run)
        if sink.seq != st.noted_seq:
            n = len(st.buf)
            self._note_seq(st, sink)
            self._grew(len(st.buf) - n)

    @property
    def state_due(self) -> bool:
        """Is a run's STATE part waiting for its interval (8.5)? The server then calls
        :meth:`flush` at its ticks even when no event went out."""
        return bool(self._state_due)

    def counters(self) -> dict[str, int]:
        """Totals since start of the journal's limits and repairs (for the heartbeat):
        ``early_flushes`` (WRITE_BUFFER_BYTES reached within a batch), ``damaged_entries``
        (set aside at load), ``runs_not_loaded`` (beyond ``max_runs`` at load),
        ``dropped_bytes`` (given up while writes failed), ``write_failures`` (a read-only or
        full data dir), ``step_series_visited`` (series looked at for STEPS blocks)."""
        return {
            "early_flushes": self.early_flushes,
            "stacks_unjournaled": self.stacks_unjournaled,
            "damaged_entries": self.damaged_entries,
            "runs_not_loaded": self.runs_not_loaded,
            "dropped_bytes": self._handles.dropped_bytes,
            "write_failures": self._handles.write_failures,
            "failing": int(self.failing),
            "step_series_visited": self._visited_gone + sum(
                st.flight.visited for st in self._files.values()),
            "unreplayable_entries": self.unreplayable_entries,
        }

    @property
    def failing(self) -> bool:
        """PROTOCOL 8.4: True while the latest write of some run failed (or, before any
        write, the start's probe did): ``/healthz`` ``journal: "failing"``."""
        return bool(self._handles.failing) or self._handles.probe_failed

    def delete_run(self, run: str, paths: Iterable[str]) -> None:
        """PROTOCOL 8.4: the run is deleted (it left memory first, if it was there): drop
        what is held for it unwritten, close its handle, and unlink ``paths`` (its journal
        and the files set aside beside it) and its journal."""
        st = self._files.pop(run, None)
        self._dirty.pop(run, None)
        if st is not None:
            self._visited_gone += st.flight.visited
            st.buf.clear()
            st.pending.clear()
            self._handles.failing.discard(run)
            self._handles.close(st, sync=False)
        journal = self._path(run)
        for path in {journal, *paths}:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("journal: cannot delete %s: %s", path, exc)

    def _grew(self, n: int) -> None:
        """``n`` more bytes are buffered: write everything at once when the buffers pass
        their bound (WRITE_BUFFER_BYTES), not at the end of the batch."""
        self._buffered += n
        if self._buffered > self._flush_at:
            self.early_flushes += 1
            log.debug("journal: %d bytes buffered; writing them before the batch ends",
                      self._buffered)
            self.flush()

    def _note_seq(self, st: RunFile, sink: RunSink) -> None:
        if st.track_records:
            seqs = sink.record_seqs
            cut = sink.epoch_line.take_cut()  # 8.1: a rewind replaced records from there on
            if cut is not None and cut < st.noted_records:
                st.noted_records = cut
            n = len(seqs)
            if n != st.noted_records:
                if n > st.noted_records:
                    for i in range(st.noted_records, n):
                        st.buf += entry(RECORD_SEQ.pack(KIND_RECORD_SEQ, i, seqs[i]))
                st.noted_records = n
                self._dirty[st.run] = st
            complete = sink.complete
            cseq = complete[0] if complete is not None else 0
            if cseq != st.noted_complete:
                st.buf += entry(SEQ.pack(KIND_COMPLETE_SEQ, cseq))
                st.noted_complete = cseq
                self._dirty[st.run] = st
            if sink.steps.rows > st.noted_steps or sink.line.cut is not None:  # (8.1 rewind)
                self._note_steps(st, sink)
        if sink.seq > st.seq_hi - self.seq_block // 2:
            self._reserve(st, sink.seq)
        st.noted_seq = sink.seq
        n = len(st.buf)
        if st.state.note(st.buf, sink):  # (8.5: alerts, GPU counters, verdict, figures)
            self._state_due[st.run] = (st, sink)
        else:
            self._state_due.pop(st.run, None)
        if len(st.buf) != n:
            self._dirty[st.run] = st

    def _note_steps(self, st: RunFile, sink: RunSink) -> None:
        """Journal the published closed steps not yet written, in blocks of bounded size."""
        store = sink.steps
        flight = st.flight
        own = sink.steps_published - flight.published  # rows the sink published itself
        flight.published = sink.steps_published
        line = sink.line
        cut = line.take_cut()  # 8.1: a rewind took rows off the line since the last block
        if cut is not None and cut < st.noted_steps:
            st.noted_steps = cut
            own = -1  # (every series: the takes' names are of rows that are gone)
        if own >= store.rows - st.noted_steps:
            names = store.in_order(sink.steps_named_since(st.noted_steps))
        else:  # rows with no frames behind them (restored, appended directly): every series
            names = list(store.metrics)
        per_row = 40 + 28 * (len(names) + 1)
        chunk = max(1, STEP_BLOCK_BYTES // per_row)
        # a block holds one attempt's rows (8.1: its "attempt", absent for attempt 0)
        bounds = [r for r, _ in line.bounds if st.noted_steps < r < store.rows]
        for start in _block_starts(st.noted_steps, store.rows, chunk, bounds):
            end = min(start + chunk, next((r for r in bounds if r > start), store.rows))
            block = wire_block(store, start, end, names, flight)
            attempt = line.attempt_of(start) if line.bounds else 0
            if attempt:
                block["attempt"] = attempt
            # when they were published and the run's updated_at then: a restored header
            # (and a non-finite loss alert's time) is what it was live
            block["published_at"] = sink.steps_published_at
            block["updated_at"] = sink.updated_at
            numbers = sink.numbers_wire()  # 8.3, when it changed (None: not written)
            if numbers is not None:
                block["numbers"] = numbers
            payload = block_encoder.encode(block)
            st.buf += entry(bytes((KIND_STEPS,)), payload)
        st.noted_steps = store.rows
        self._dirty[st.run] = st

    def flush(self) -> None:
        """Write every buffered entry (one ``os.pwrite`` per dirty run); fsync at most once
        per ``fsync_interval``. Write errors are logged, never raised."""
        if self._state_due:
            for run, (st, sink) in list(self._state_due.items()):
                n = len(st.buf)
                if not st.state.note(st.buf, sink):
                    del self._state_due[run]
                if len(st.buf) != n:
                    self._dirty[run] = st
        if (self.retry_interval and self._dirty and self.failing
                and self._buffered <= _writer._MAX_BUFFER):
            mono = time.monotonic()
            if mono < self._retry_at:  # PROTOCOL 8.4: retried, not on every batch
                self._flush_at = self._buffered + WRITE_BUFFER_BYTES
                self._note_floor()
                return
            self._retry_at = mono + self.retry_interval
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            for st in dirty.values():
                if st.buf:
                    self._handles.write(st, self._buffered)
                    if st.buf:  # failed: keep it for the next flush
                        self._dirty[st.run] = st
        self._buffered = sum(len(st.buf) for st in self._dirty.values())
        self._flush_at = self._buffered + WRITE_BUFFER_BYTES
        self._note_floor()
        self._handles.sync_due()

    def _note_floor(self) -> None:
        """While writes fail, the highest reservation of any run goes to SEQFLOOR (written
        in place, before the ids it covers are published): see broker/journal/seqfloor.py."""
        if not self._handles.failing:
            self._floor_all = False
            return
        if not self._floor_all:  # writes just began to fail: every run's reservation
            self._floor_all = True
            for st in self._files.values():
                if st.seq_hi > self._floor_due:
                    self._floor_due = st.seq_hi
        self._floor.raise_to(self._floor_due)

    def forget(self, run: str) -> None:
        """The run left memory: write what is held for it and close its handle (the file
        stays; :meth:`load_run` rebuilds it)."""
        st = self._files.pop(run, None)
        if st is None:
            return
        self._visited_gone += st.flight.visited
        due = self._state_due.pop(run, None)
        if due is not None:
            st.state.note(st.buf, due[1], force=True)
        self._write_pending(st)
        self._dirty.pop(run, None)
        if st.buf:
            self._handles.write(st)
            if st.buf:
                log.error("journal: run %r left memory with %d bytes (%d frames) unwritten",
                          run, len(st.buf), st.buf_frames)
        self._handles.failing.discard(run)
        self._handles.close(st)

    def close(self) -> None:
        """Write everything held (coalesced samples included), fsync, close, unlock."""
        if self._closed:
            return
        self._closed = True
        for st, sink in self._state_due.values():
            st.state.note(st.buf, sink, force=True)
        self._state_due.clear()
        for st in self._files.values():
            self._write_pending(st)
            if st.buf:
                self._dirty[st.run] = st
        self.retry_interval = 0.0  # the last chance: tried now, whenever the last try was
        self.flush()
        for st in self._files.values():  # PROTOCOL 8.4: what a restart will not find
            if st.buf_frames or st.missing_frames:
                log.error("journal: %d frames of run %r could not be written and are missing "
                          "from disk", st.buf_frames + st.missing_frames, st.run)
        self._handles.close_all()
        self._floor.close()
        self._files.clear()
        self._dirty.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: state and writing --------------------------------------------------

    def _path(self, run: str) -> str:
        return os.path.join(self.runs_dir, run + _SUFFIX)

    def _new_state(self, run: str) -> RunFile:
        st = RunFile(run, self._path(run))
        try:
            existing = os.stat(st.path).st_size
        except OSError:
            existing = 0
        if existing > len(HEADER):
            # A history this Journal did not rebuild (the server made a fresh sink over it):
            # keep appending, but do not pair its record indices with the old ones.
            st.started = True
            st.track_records = False
            log.warning("journal: run %r restarted in memory over an existing journal; "
                        "use Journal.load_run() to rebuild it instead", run)
        self._files[run] = st
        return st

    def _write_pending(self, st: RunFile) -> None:
        """Buffer the held ``resources`` frames of a run, oldest first."""
        if not st.pending:
            return
        pending = st.pending
        held = list(pending.values()) if len(pending) == 1 else sorted(pending.values(), key=_time_of)
        pending.clear()
        encode = protocol.encoder.encode
        for t, frame in held:
            append_frame(st.buf, t, encode(frame))
        st.buf_frames += len(held)
        st.started = True
        self._dirty[st.run] = st

    def _reserve(self, st: RunFile, seq: int) -> None:
        st.seq_hi = seq + self.seq_block
        st.buf += entry(SEQ.pack(KIND_SEQ_HI, st.seq_hi))
        self._dirty[st.run] = st
        if st.seq_hi > self._floor_due and self._handles.failing:
            self._floor_due = st.seq_hi  # (SEQFLOOR: written by the flush before any use)

    # -- internals: loading ------------------------------------------------------------

    def _load_guarded(self, run: str, stale_after: float, horizon: float | None,
                      step_close_after: float, now: float | None) -> RunSink | None:
        """:meth:`_load_file`, which cannot stop the broker's start: replay already costs a
        bad entry only that entry, so an exception here is a bug in rebuilding the run as a
        whole; its file goes aside (its bytes kept) and every other run loads (issue 38)."""
        try:
            return self._load_file(run, stale_after, horizon, step_close_after, now)
        except Exception as exc:
            log.error("journal: run %r cannot be rebuilt (%s: %s)", run, type(exc).__name__,
                      exc)
            self.forget(run)  # (a handle it may have opened)
            self.unreplayable_entries += 1
            set_aside(self._path(run), f"rebuilding it failed: {type(exc).__name__}")
            return None

    def _load_file(self, run: str, stale_after: float, horizon: float | None,
                   step_close_after: float = 10.0, now: float | None = None) -> RunSink | None:
        path = self._path(run)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("journal: skipping run %r: cannot read %s: %s", run, path, exc)
            return None
        if not data.startswith(HEADER):
            if len(data) < len(HEADER) and HEADER.startswith(data):
                return None  # torn at creation: nothing was ever recorded; rewritten on use
            found = data[:len(HEADER)].strip().decode("ascii", "replace")
            why = (f"journal format {found!r}" if data.startswith(HEADER_PREFIX)
                   else "not a rankboard journal")
            set_aside(path, why)
            return None

        body = data[len(HEADER):]
        scan = scan_entries(body)
        entries, good, problem = scan.entries, scan.end, scan.problem
        if problem is not None:
            dropped = len(body) - good
            log.warning("journal: %s: %s at byte %d; dropping the last %d bytes and keeping the "
                        "%d entries before", path, problem, len(HEADER) + good, dropped,
                        len(entries))
        size = len(HEADER) + good
        got = replay(run, path, entries, stale_after=stale_after,
                     step_close_after=step_close_after, now=now)
        sink = got.sink
        aside = list(scan.damaged)
        if scan.damaged:
            # Damage in the middle (PROTOCOL 6): only the damaged bytes go, and they go aside.
            self.damaged_entries += len(scan.damaged)
            a, b = scan.damaged[0]
            log.warning("journal: %s: %s at byte %d; skipping %d bytes to the next good entry",
                        path, scan.damage_reason, len(HEADER) + a, b - a)
        if got.failed:
            # Entries whose replay raised (issue 38): good bytes this version cannot apply.
            # They go aside as damaged bytes do, so every later start (and export) does not
            # meet them again; the rest of the run, and every other run, is rebuilt.
            self.unreplayable_entries += len(got.failed)
            log.warning("journal: %s: %d entries could not be replayed; setting them aside",
                        path, len(got.failed))
            aside = sorted(aside + [(scan.offsets[i], scan.offsets[i] + ENTRY_HEAD.size + 1
                                     + len(entries[i][1])) for i in got.failed])
        if aside and got.frames and got.applied:
            cut = cut_damage(path, HEADER, body, aside, good)
            if cut is not None:
                size, problem = cut, None  # the rewrite cut the torn tail too
        if got.frames == 0:
            # Nothing (readable) in it: no run. Its first frame is gone, so is everything.
            remove(path)
            return None
        if got.applied == 0:
            set_aside(path, "none of its frames can be replayed")
            return None
        if (horizon is not None and sink.complete is not None and got.last_time is not None
                and got.last_time < horizon):
            log.info("journal: deleting finished run %r (last frame %.0f s ago)", run,
                     time.time() - got.last_time)
            remove(path)
            self.deleted_at_load += 1
            return None

        st = RunFile(run, path)
        st.size = size
        st.started = True
        st.noted_records = got.noted_records
        st.noted_complete = got.noted_complete
        st.noted_steps = sink.steps.rows
        st.unchanged = got.unchanged
        st.stacks_bytes = got.stacks_bytes
        st.flight.published = sink.steps_published
        st.state.loaded(sink)
        if sink.seq < self._floor.value:  # ids issued while writes failed (SEQFLOOR)
            sink.seq = self._floor.value
        if problem is not None:
            self._handles.truncate(st)
        self._files[run] = st
        # Reserve first: note_seq would otherwise reserve too (seq_hi is still 0), and the
        # block would be written twice.
        self._reserve(st, sink.seq)
        self._note_seq(st, sink)  # notes any fresh ids above
        return sink


def _block_starts(start: int, end: int, chunk: int, bounds: list[int]) -> list[int]:
    """First rows of the STEPS blocks over rows ``[start, end)``: every ``chunk`` rows, and
    anew at each attempt's first row (``bounds``, 8.1), so a block is one attempt's."""
    out: list[int] = []
    cuts = sorted(set(bounds)) + [end]
    pos = start
    for stop in cuts:
        while pos < stop:
            out.append(pos)
            pos = min(pos + chunk, stop)
    return out

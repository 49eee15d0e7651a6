"""The data dir, bounded in bytes and in days (PROTOCOL 8.4): which ended runs to delete.

A broker runs for months and its data dir would otherwise only grow. ``--retain-bytes``
bounds the runs' files (a journal and what was set aside beside it, as bytes on disk);
``--retention-days`` bounds their age. Both delete whole **ended** runs, least recently
updated first, never a live one, at start and every :data:`DEFAULT_INTERVAL` seconds.

Three parts, so that nothing slow runs on the broker's receive loop:

* :func:`scan_runs` lists ``runs/`` and stats each file (10,000 journals: well under 2 s,
  ``bench/retention_bench.py``): I/O, done by :class:`RetentionWorker`'s thread;
* :func:`plan` is pure: given what is on disk and what the loop said of the runs it holds
  (:class:`MemRun`, one attribute read per run), the runs to delete and why; also in the
  thread;
* the loop applies the plan (``broker/server.py``), a bounded number of runs per turn, each
  checked again first (a frame that arrived since the snapshot keeps its run).

Why the file's mtime stands for a run not in memory: the header's ``updated_at`` is the
time of its latest frame, and the journal is written (within one batch) after each frame
it keeps, so the file's mtime is that time or a little after; reading 10,000 journals to
find it would cost far more than the 2 s a pass may take. A run not in memory is ended when
that time is more than ``--stale-after`` older than the newest in the data dir (the
contract's rule, which keeps every run after a long upgrade); a run in memory is ended when
its status is ``complete``/``failed``, or no rank of it is ``ok`` (finished, failed or
stale), or by the same time rule (at start, before ticks have marked anything stale).
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from rank_agent.protocol import valid_run_id

__all__ = ["parse_size", "DiskRun", "MemRun", "Plan", "scan_runs", "plan", "RetentionWorker",
           "DEFAULT_INTERVAL", "INTERVAL_ENV", "interval_from_env", "LIVE_OVER_LOG_S"]

log = logging.getLogger(__name__)

#: Seconds between two passes while the broker runs (the contract: a run is gone within 60 s
#: of becoming eligible; a pass takes well under 2 s, and the loop applies it within a tick).
DEFAULT_INTERVAL = 30.0
#: The environment variable that sets the interval (seconds; for tests: not a flag, because
#: nobody should need it; values above the default are refused, the contract's 60 s holds).
INTERVAL_ENV = "RANKBOARD_RETENTION_INTERVAL"
#: "Live runs alone exceed the bound" is logged at most this often (seconds).
LIVE_OVER_LOG_S = 600.0

_SUFFIX = ".journal"
_SIZE = re.compile(r"([0-9]+)([kmgtKMGT]?)")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """``--retain-bytes``: a whole number of bytes, or with a suffix K, M, G or T in either
    case (powers of 1,024). ValueError (a message without the flag's name) for anything
    else or for a size ≤ 0."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (a whole number of bytes, or with K, M, G "
                         "or T, e.g. 500G)")
    value = int(m.group(1)) * 1024 ** _POWERS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"must be more than 0 bytes, got {text!r}")
    return value


def interval_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """The pass interval: :data:`INTERVAL_ENV` when it holds a number in (0, default], else
    :data:`DEFAULT_INTERVAL` (a bad value is logged, not fatal: it is a test knob)."""
    text = environ.get(INTERVAL_ENV)
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= DEFAULT_INTERVAL:
        log.warning("retention: ignoring %s=%r (a number of seconds in (0, %g])", INTERVAL_ENV,
                    text, DEFAULT_INTERVAL)
        return DEFAULT_INTERVAL
    return value


@dataclass(frozen=True)
class DiskRun:
    """One run's files in ``runs/``: their bytes on disk, and the journal's mtime (unix s)."""

    run: str
    bytes: int
    mtime: float
    #: every file of the run: the journal (if any) and what was set aside beside it
    paths: tuple[str, ...]


@dataclass(frozen=True)
class MemRun:
    """What the loop says of a run it holds: its ``updated_at`` and whether it has ended by
    its own state (status, or no rank ``ok``)."""

    updated_at: float | None
    ended: bool


@dataclass
class Plan:
    """A pass's outcome: ``victims`` as ``(run, reason, updated_at, files, bytes)`` in deletion
    order (``reason`` ``"days"`` or ``"bytes"``; ``updated_at`` as judged, so the loop can
    tell that a run moved since), the runs' bytes before deleting (``total``), and
    ``live_over``: the bytes still above the bound once every ended run is gone (0: none)."""

    victims: list[tuple[str, str, float | None, tuple[str, ...], int]] = field(default_factory=list)
    total: int = 0
    live_over: int = 0
    scanned: int = 0


def _disk_bytes(st: os.stat_result) -> int:
    blocks = getattr(st, "st_blocks", None)
    return int(blocks) * 512 if blocks is not None else int(st.st_size)


def scan_runs(runs_dir: str) -> dict[str, DiskRun]:
    """Every run with a file in ``runs_dir``: its journal ``<run>.journal`` and the files set
    aside beside it (``<run>.journal.<anything>``). A file that vanishes meanwhile is skipped;
    a dir that cannot be listed is ``{}`` (logged)."""
    sizes: dict[str, int] = {}
    mtimes: dict[str, float] = {}
    paths: dict[str, list[str]] = {}
    journals: set[str] = set()
    try:
        it = os.scandir(runs_dir)
    except OSError as exc:
        log.warning("retention: cannot list %s: %s", runs_dir, exc)
        return {}
    with it:
        for entry in it:
            name = entry.name
            if name.endswith(_SUFFIX):
                run, journal = name[: -len(_SUFFIX)], True
            else:
                head, sep, _ = name.rpartition(_SUFFIX + ".")
                if not sep:
                    continue
                run, journal = head, False
            if not valid_run_id(run):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            sizes[run] = sizes.get(run, 0) + _disk_bytes(st)
            paths.setdefault(run, []).append(entry.path)
            # the journal's own mtime; a run with only set-aside files: their newest
            if journal:
                mtimes[run] = st.st_mtime
                journals.add(run)
            elif run not in journals and st.st_mtime > mtimes.get(run, 0.0):
                mtimes[run] = st.st_mtime
    return {run: DiskRun(run, sizes[run], mtimes[run], tuple(paths[run])) for run in sizes}


def plan(disk: Mapping[str, DiskRun], memory: Mapping[str, MemRun], *,
         retain_bytes: int | None, retention_days: float | None, stale_after: float,
         now: float) -> Plan:
    """The runs to delete (module docstring): ended runs older than ``retention_days``
    (reason ``days``), then ended runs least recently updated first while the runs' bytes
    exceed ``retain_bytes`` (reason ``bytes``). Pure."""
    # The newest frame: a held run's updated_at, else the file's mtime (a held run's file
    # was just written by the start's load, whatever the age of its frames: its mtime
    # would make every run of a long-stopped broker look old).
    newest = 0.0
    for run, d in disk.items():
        held = memory.get(run)
        if held is None:
            newest = max(newest, d.mtime)
        elif held.updated_at is not None:
            newest = max(newest, held.updated_at)
    for m in memory.values():
        if m.updated_at is not None:
            newest = max(newest, m.updated_at)
    ended: list[tuple[float, str]] = []  # (updated_at, run)
    total = 0
    for run, d in disk.items():
        total += d.bytes
        held = memory.get(run)
        if held is not None:
            updated = held.updated_at if held.updated_at is not None else d.mtime
            done = held.ended or newest - updated > stale_after
        else:
            updated = d.mtime
            done = newest - updated > stale_after
        if done:
            ended.append((updated, run))
    ended.sort()
    out = Plan(total=total, scanned=len(disk))
    gone: set[str] = set()
    if retention_days is not None:
        horizon = now - retention_days * 86400.0
        for updated, run in ended:
            if updated >= horizon:
                break
            gone.add(run)
            out.victims.append((run, "days", _judged(memory, run), disk[run].paths,
                                disk[run].bytes))
    if retain_bytes is not None:
        left = total - sum(disk[run].bytes for run in gone)
        for _, run in ended:
            if left <= retain_bytes:
                break
            if run in gone:
                continue
            gone.add(run)
            left -= disk[run].bytes
            out.victims.append((run, "bytes", _judged(memory, run), disk[run].paths,
                                disk[run].bytes))
        if left > retain_bytes:
            out.live_over = left - retain_bytes
    return out


def _judged(memory: Mapping[str, MemRun], run: str) -> float | None:
    held = memory.get(run)
    return held.updated_at if held is not None else None


class RetentionWorker:
    """The pass in a thread of its own: :meth:`submit` hands it the loop's view of the runs
    it holds, :meth:`take` gives the finished :class:`Plan` back (None until then). The loop
    never waits for it; one pass at a time (a submit while one runs is ignored)."""

    def __init__(self, runs_dir: str, *, retain_bytes: int | None,
                 retention_days: float | None, stale_after: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.runs_dir = runs_dir
        self.retain_bytes = retain_bytes
        self.retention_days = retention_days
        self.stale_after = stale_after
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._job: dict[str, MemRun] | None = None
        self._busy = False
        self._done: Plan | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        #: seconds the latest pass took (scan and plan)
        self.last_pass_s = 0.0

    def run_now(self, memory: Mapping[str, MemRun]) -> Plan:
        """One pass in the caller's thread (the start pass, before the loop serves)."""
        t0 = time.perf_counter()
        out = plan(scan_runs(self.runs_dir), memory, retain_bytes=self.retain_bytes,
                   retention_days=self.retention_days, stale_after=self.stale_after,
                   now=self.clock())
        self.last_pass_s = time.perf_counter() - t0
        return out

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="rankboard-retention",
                                            daemon=True)
            self._thread.start()

    def submit(self, memory: dict[str, MemRun]) -> bool:
        """Ask for a pass over ``memory`` (the loop's view); False while one is under way."""
        with self._lock:
            if self._busy or self._job is not None or self._done is not None:
                return False
            self._job = memory
            self._wake.notify()
            return True

    def take(self) -> Plan | None:
        """The finished pass's plan, once (None while there is none)."""
        with self._lock:
            done, self._done = self._done, None
            return done

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _main(self) -> None:
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._wake.wait()
                if self._closed or self._job is None:
                    return
                job, self._job = self._job, None
                self._busy = True
            try:
                result: Plan | None = self.run_now(job)
            except Exception:  # a bug must not end the thread: the next pass tries again
                log.exception("retention: a pass over %s failed", self.runs_dir)
                result = None
            with self._lock:
                self._busy = False
                self._done = result


"""``rankboard export RUN [-o FILE] [--data-dir DIR]``: a run's report.html from its journal.

PROTOCOL 6: it works with or without a broker running on the data dir, so it reads and never
writes. It does not take the dir's ``LOCK`` (a live broker holds it), writes no ``VERSION``,
sets no damaged bytes aside and cuts no torn tail: it reads the run's file once and replays
its entries in memory exactly as a restart would (:func:`broker.journal.codec.scan_entries`
reading past damage in the middle and stopping before a torn tail, then
:func:`broker.journal.replay.replay`), which is what ``Journal.load`` does before it starts
writing. A broker appending while we read is harmless: we see a prefix of its entries, with
at worst a torn last one, read like a restart reads it.

An unknown run, or a data dir holding no journal, is one line on stderr naming it, exit 1,
and no file: the report is written to a temporary file beside FILE and renamed into place
only once complete, so a failure midway leaves nothing behind either.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from broker.journal.codec import HEADER, scan_entries
from broker.journal.replay import replay
from broker.run.sink import RunSink
from rank_agent.protocol import valid_run_id
from web.report import RunReport, attachment_name, from_parts, render
from web.stacksview import RunDumps

__all__ = ["ExportError", "load_run", "export_main", "report_of_sink"]

log = logging.getLogger(__name__)

_SUFFIX = ".journal"


class ExportError(Exception):
    """A user's mistake or a missing run: ``str()`` is the one line for stderr."""


def load_run(data_dir: Path, run: str) -> RunSink:
    """``run`` rebuilt in memory from its journal under ``data_dir`` (read-only; see the
    module docstring); :class:`ExportError` when there is no such journal or run."""
    runs_dir = data_dir / "runs"
    if not (data_dir / "VERSION").is_file() and not runs_dir.is_dir():
        raise ExportError(f"no journal in data dir {data_dir}")
    if not valid_run_id(run):
        raise ExportError(f"not a run id: {run!r}")
    path = runs_dir / (run + _SUFFIX)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ExportError(f"no run {run!r} in data dir {data_dir}") from None
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not data.startswith(HEADER):
        raise ExportError(f"run {run!r}: {path} is not a readable rankboard journal")
    scan = scan_entries(data[len(HEADER):])
    if scan.problem is not None:
        log.info("export: %s: %s at the end (a torn tail, read as a restart reads it)",
                 path, scan.problem)
    got = replay(run, str(path), scan.entries, stale_after=30.0, step_close_after=10.0,
                 now=None)
    if got.applied == 0:
        raise ExportError(f"no run {run!r} in data dir {data_dir} (its journal holds no "
                          "frame that can be replayed)")
    return got.sink


def report_of_sink(sink: RunSink) -> RunReport:
    """The report of a rebuilt run (the sink's own step store, not a copy), its journaled
    stack dumps grouped as a web groups them (after a replay no rank is ``stalled``, so
    the groups are the latest request's answers)."""
    ranks = sink.ranks()
    stacks = RunDumps.from_snapshot(sink.stacks.wire()).view(ranks, sink.seq)
    rep = from_parts(sink.run, sink.header(), ranks, sink.records, sink.steps,
                     sink.svg, stacks)
    rep.line = sink.line  # 8.1: the superseded records
    rep.epochs_superseded = list(sink.epoch_line.superseded)
    return rep


def write_report(report: RunReport, out: Path) -> int:
    """Write ``report`` to ``out`` atomically (a temporary file renamed); bytes written."""
    directory = out.parent if str(out.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=".rankboard-export-", suffix=".html", dir=directory)
    size = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            for chunk in render(report):
                fh.write(chunk)
                size += len(chunk.encode("utf-8"))
        umask = os.umask(0)  # mkstemp made it 0600; a report is a document, like any other file
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size


def export_main(run: str, output: Path | None, data_dir: Path) -> int:
    """The command: 0 and the file written, or 1 with one line on stderr and no file."""
    prog = "rankboard export"
    try:
        sink = load_run(data_dir, run)
        out = output if output is not None else Path(attachment_name(run))
        size = write_report(report_of_sink(sink), out)
    except ExportError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"{prog}: cannot write the report: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    log.info("wrote %s (%d bytes): run %s", out, size, run)
    return 0

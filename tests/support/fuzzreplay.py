"""The fuzz's traffic through a broker's journal and back (issue 38): frames accepted live are
journaled as the server journals them, the journal is replayed into fresh sinks as a restart
replays it, and the two states are compared. In process, no sockets: ``Runs`` wired to a real
:class:`~broker.journal.journal.Journal` in a temporary dir exactly as ``broker/server.py``
wires it (recorder, sample recorder, ``note_seq`` after events, a flush per batch).

What "the same state" means is what a restart promises (PROTOCOL 6, docs/DESIGN.md): every
run, its header's identity and status, its epoch records with their ids, its ranks, its
closed steps, its alerts. Not compared, as the journal does not keep them by design: the
liveness of ranks (a restart starts their clocks again), points of steps not closed, ids of
events other than records (they are only promised to be above the old ones).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable

from broker.journal.journal import Journal
from broker.run.sink import RunSink
from broker.runs import Runs
from rank_agent import protocol

__all__ = ["journal_and_replay", "state_of", "differences", "extremes", "FRAME_89"]

#: header keys that are liveness or the clock's, not what the run is
_LIVE_HEADER = frozenset({"updated_at", "stale_ranks", "live_ranks", "elapsed_secs", "alerts",
                          "data_stragglers"})
#: a rank's liveness (its clock starts again at a restart; replay forgets stalls, PROTOCOL 2)
_LIVE_STATUS = {"stale": "ok", "stalled": "ok"}
#: alerts of the ticks and the clock, which are not replayed (a restart raises them again)
_LIVE_ALERTS = frozenset({"stale", "stalled", "data_straggler", "collective_behind",
                          "collective_mismatch"})


def journal_and_replay(msgs: Iterable[bytes], data_dir: Path, *, tick_every: int = 50,
                       t0: float = 1_800_000_000.0) -> tuple[Runs, dict[str, RunSink], Journal]:
    """Feed ``msgs`` to a journaled ``Runs`` (a fake clock, 1 ms a frame; a tick every
    ``tick_every``), settle every run (its closed steps published and journaled, as an
    eviction does), close the journal and load a fresh one on the same dir. Returns the
    live runs, the replayed sinks and the journal that replayed them (its counters)."""
    journal = Journal(data_dir)
    journal.load()
    runs = Runs(max_runs=100_000, recorder=journal.accept)
    runs.sample_recorder = journal.accept_samples
    runs.on_settle = journal.note_seq
    now = t0

    def noted(events: list[tuple[str, Any]]) -> None:
        for run in {run for run, _ in events}:
            sink = runs.get(run)
            if sink is not None:
                journal.note_seq(sink)
        journal.flush()

    for i, data in enumerate(msgs):
        now += 0.001
        noted(runs.ingest(data, now))
        if i % tick_every == 0:
            noted(runs.tick(now))
    for run in list(runs):
        sink = runs.get(run)
        assert sink is not None
        events = sink.settle(now)
        if events:
            journal.note_seq(sink)
    journal.flush()
    journal.close()
    again = Journal(data_dir)
    return runs, again.load(), again


def _plain(value: Any) -> Any:
    """JSON-comparable: NaN as a string (NaN != NaN), tuples as lists."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr,
                                 allow_nan=True).replace("NaN", '"NaN"'))


def state_of(sink: RunSink) -> dict[str, Any]:
    """What a restart must keep of ``sink`` (module docstring), comparable with ``==``."""
    header = {k: v for k, v in sink.header().items() if k not in _LIVE_HEADER}
    ranks = [{k: (_LIVE_STATUS.get(v, v) if k == "status" else v) for k, v in r.items()
              if k in ("rank", "host", "local_rank", "status", "epoch", "pid", "hardware")}
             for r in sink.ranks()]
    steps = {name: sink.steps.column(name).tolist() for name in ("step", "n")}
    return _plain({
        "header": header, "ranks": ranks, "records": sink.records,
        "record_seqs": list(sink.record_seqs), "steps": steps,
        "alerts": [{k: a[k] for k in ("kind", "rank", "message")}
                   for a in sink.alerts.listed() if a["kind"] not in _LIVE_ALERTS],
    })


def differences(live: Runs, replayed: dict[str, RunSink]) -> list[str]:
    """Where the replayed runs differ from the live ones (empty: none)."""
    out: list[str] = []
    names = set(live)
    if names != set(replayed):
        out.append(f"runs: live only {sorted(names - set(replayed))[:5]}, replayed only "
                   f"{sorted(set(replayed) - names)[:5]}")
    for run in sorted(names & set(replayed)):
        sink = live.get(run)
        assert sink is not None
        a, b = state_of(sink), state_of(replayed[run])
        for key in a:
            if a[key] != b[key]:
                out.append(f"{run}: {key} differs: live {str(a[key])[:300]} / replayed "
                           f"{str(b[key])[:300]}")
    return out


#: Issue 38's frame: 89 bytes, a data wait of 1e307 ms over a step of 1 ms. Live it made every
#: publish of its run raise; journaled, it made every start of the broker raise.
FRAME_89 = protocol.encoder.encode(protocol.Steps(
    run="run-01", rank=0, steps=[1], times=[1.0], step_ms=[1.0], data_ms=[1e307]))


def extremes(rng: random.Random, msgs: list[bytes]) -> list[bytes]:
    """``msgs`` with issue 38's frames put in at random places: :data:`FRAME_89`, and
    collectives frames of a group id of Unicode digits (``"²"``) between ordinary ones."""
    extra = [FRAME_89]
    for rank in range(3):
        groups = [protocol.ProcessGroupStatus(pg="0", size=3, last_enqueued=5 - (rank == 2),
                                              last_completed=4)]
        if rank == 1:
            groups.append(protocol.ProcessGroupStatus(pg="\u00b2", last_enqueued=1))
        extra.append(protocol.encoder.encode(protocol.Collectives(
            run="run-02", rank=rank, reason="stall", taken_at=1.0, groups=groups,
            entries=[protocol.CollectiveEntry(pg=g.pg, seq=g.last_enqueued, op="x")
                     for g in groups])))
    out = list(msgs)
    for data in extra:
        out.insert(rng.randrange(len(out) + 1), data)
    return out

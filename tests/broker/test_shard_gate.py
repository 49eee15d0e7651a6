"""``--shard K/N`` in the broker (PROTOCOL 7.3): ``wrong_shard`` rejects leave nothing behind;
the journal's runs are served whatever the hash says; the header carries ``shard``."""
from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from broker.runs import Runs
from broker.server import BrokerServer
from broker.shardgate import CACHE_RUNS, ShardGate
from rank_agent.protocol import Resources, ResourceSample
from rank_agent.shards import shard_of
from tests.support.frames import enc, metrics, register

T0 = 1_000_000.0
RUNS = [f"job-{i}" for i in range(40)]
MINE = [r for r in RUNS if shard_of(r, 2) == 1]
OTHERS = [r for r in RUNS if shard_of(r, 2) == 0]


def _runs(**kw: object) -> Runs:
    runs = Runs(**kw)  # type: ignore[arg-type]
    runs.shard = 1
    runs.owns = ShardGate(1, 2)
    return runs


def test_wrong_shard_is_rejected_counted_and_makes_nothing() -> None:
    runs = _runs()
    assert runs.ingest(enc(register(OTHERS[0])), T0) == []
    assert runs.ingest(enc(metrics(OTHERS[0])), T0) == []
    assert runs.rejected == {"wrong_shard": 2}
    assert len(runs) == 0 and OTHERS[0] not in runs and runs.accepted == 0
    events = runs.ingest(enc(register(MINE[0])), T0)
    assert events and runs.rejected == {"wrong_shard": 2} and MINE[0] in runs
    header = runs.get(MINE[0]).header()  # type: ignore[union-attr]
    assert header["shard"] == 1


def test_held_samples_of_a_wrong_run_are_rejected_too() -> None:
    runs = _runs(hold_samples=True)
    runs.ingest(enc(register(MINE[0])), T0)
    sample = Resources(run=OTHERS[0], rank=0, sample=ResourceSample(cpu_percent=1.0))
    assert runs.ingest(enc(sample), T0) == []
    assert runs.release_samples(T0) == []
    assert runs.rejected == {"wrong_shard": 1} and OTHERS[0] not in runs


def test_one_shard_takes_everything() -> None:
    runs = Runs()
    for run in RUNS:
        runs.ingest(enc(register(run)), T0)
    assert len(runs) == len(RUNS) and not runs.rejected
    assert {runs.get(r).header()["shard"] for r in RUNS} == {0}  # type: ignore[union-attr]


def test_a_run_the_journal_holds_is_served_whatever_the_hash() -> None:
    asked: List[str] = []

    def held(run: str) -> bool:
        asked.append(run)
        return run == OTHERS[1]

    gate = ShardGate(1, 2, held=held)
    assert gate(OTHERS[1]) and not gate(OTHERS[2]) and gate(MINE[0])
    for _ in range(5):  # cached: the journal is asked once per run id
        gate(OTHERS[1]), gate(OTHERS[2])
    assert asked == [OTHERS[1], OTHERS[2]]


def test_the_cache_is_bounded() -> None:
    gate = ShardGate(0, 3)
    for i in range(CACHE_RUNS + 10):
        gate(f"r{i}")
    assert len(gate._verdicts) <= CACHE_RUNS


def test_bad_gate() -> None:
    with pytest.raises(ValueError):
        ShardGate(2, 2)
    with pytest.raises(ValueError):
        ShardGate(0, 1025)  # (issue 38: past it the hash overflows on every new run)


def test_server_keeps_its_journals_runs_after_n_changed(tmp_path: Path) -> None:
    """A journal written by a broker of one shard (N = 1) is read by a broker of shard 1/2:
    the runs it holds stay served (frames accepted), a new run of shard 0 is refused and
    leaves no journal file."""
    old = OTHERS[3]
    first = BrokerServer("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                         data_dir=tmp_path)
    first.bind()
    try:
        first.runs.ingest(enc(register(old)), T0)
        first.runs.ingest(enc(metrics(old, epoch=0)), T0)
        first.runs.release_samples(T0)
    finally:
        first.close()
    second = BrokerServer("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                          data_dir=tmp_path, shard=(1, 2), max_runs=1)
    second.bind()
    try:
        assert old in second.runs and second.runs.get(old).header()["shard"] == 1  # type: ignore[union-attr]
        second.runs.ingest(enc(metrics(old, epoch=1)), T0)
        assert not second.runs.rejected
        # evicted (max_runs=1) by a run of its own shard, then brought back from the journal
        second.runs.ingest(enc(register(MINE[1])), T0)
        assert old not in second.runs
        second.runs.ingest(enc(metrics(old, epoch=2)), T0)
        assert old in second.runs and not second.runs.rejected
        second.runs.ingest(enc(register(OTHERS[4])), T0)
        assert second.runs.rejected == {"wrong_shard": 1}
    finally:
        second.close()
    files = {p.name for p in (tmp_path / "runs").iterdir()}
    assert f"{OTHERS[4]}.journal" not in files and f"{old}.journal" in files

"""The parts of a run's state that own their rules (issue 44): :class:`RunEpochs` and the
collective verdict of :class:`StackFeed`, driven alone, without a sink: each is handed the
callbacks it needs (``emit``, ``raise``) and says what it did through them."""
from __future__ import annotations

import math
from typing import Any, List, Tuple

from broker.run.epochs import RunEpochs
from broker.run.rankstate import RankSamples, RankState
from broker.run.steps.line import EpochLine
from broker.run.topology import Topology
from broker.stacks.collectives import collective_verdict
from broker.stacks.feed import StackFeed
from broker.stacks.store import RunStacks
from rank_agent.protocol import CollectiveEntry, Collectives, Metrics, ProcessGroupStatus

RUN = "parts"


def coll(rank: int, enqueued: int) -> Collectives:
    groups = [ProcessGroupStatus(pg="0", desc="default_pg", size=3, last_enqueued=enqueued,
                                 last_completed=enqueued - 1)]
    entries = [CollectiveEntry(pg="0", seq=s, op="gloo:all_reduce", input_sizes=[[4, 8]],
                               state="scheduled") for s in range(enqueued - 2, enqueued + 1)]
    return Collectives(run=RUN, rank=rank, reason="stall", taken_at=100.0 + rank,
                       groups=groups, entries=entries)


def test_the_feed_forms_its_verdict_only_when_a_frame_came_or_currency_moved() -> None:
    sent: List[Tuple[str, Any]] = []

    def emit(kind: str, data: Any) -> int:
        sent.append((kind, data))
        return len(sent)

    feed = StackFeed(RunStacks(), emit, RUN)
    for rank, seq in ((0, 5), (1, 5), (2, 3)):
        feed.put_collectives(coll(rank, seq))
    formed = feed.refresh_verdict(lambda r: True, 3)
    assert formed is not None
    previous, verdict, any_current = formed
    assert previous == [] and verdict and any_current
    assert verdict == collective_verdict(feed.collectives.digests(frozenset({0, 1, 2})), 3)
    assert feed.verdict == verdict and feed.verdict_due  # kept, and due in the next event
    assert feed.refresh_verdict(lambda r: True, 3) is None  # nothing changed: not redone
    # rank 2's loop moved: its frame is no longer current, the verdict is formed again
    again = feed.refresh_verdict(lambda r: r != 2, 3)
    assert again is not None and again[0] == verdict and feed.coll_current == {0, 1}
    feed.publish_due(0.0)
    assert [kind for kind, _ in sent] == ["stacks"] and sent[0][1]["verdict"] == feed.verdict
    # a world size of 2 discards the frame of rank 2 before the verdict
    feed.put_collectives(coll(2, 3))
    feed.refresh_verdict(lambda r: True, 2)
    assert 2 not in feed.collectives.latest


def _report(epochs: RunEpochs, ranks: dict[int, RankState], epoch: int, loss: float
            ) -> List[int | None]:
    return [epochs.report(Metrics(run=RUN, rank=r, epoch=epoch, avg_loss=loss), st)
            for r, st in sorted(ranks.items())]


def test_run_epochs_close_through_the_handed_emit_and_raise() -> None:
    emitted: List[Tuple[str, Any]] = []
    raised: List[Tuple[Any, ...]] = []

    def emit(kind: str, data: Any) -> int:
        emitted.append((kind, data))
        return 100 + len(emitted)

    epochs = RunEpochs(emit, lambda *alert: raised.append(alert))
    ranks = {r: RankState(r, 0.0) for r in range(2)}
    topology = Topology()
    close = dict(world_size=2, started_at=0.0, samples=RankSamples(topology.place),
                 topology=topology, total_epochs=0, attempt=0, line=EpochLine())

    assert _report(epochs, ranks, 0, 1.5) == [1, 2]  # reporters of epoch 0 so far
    assert ranks[1].epoch == 0 and ranks[1].loss == 1.5
    epochs.close_through(0, now=10.0, **close)  # type: ignore[arg-type]
    assert [kind for kind, _ in emitted] == ["epoch"]
    assert epochs.records == [emitted[0][1]] and epochs.record_seqs == [101]
    assert epochs.records[0]["epoch"] == 0 and epochs.records[0]["attempt"] == 0
    assert epochs.durations and not raised

    assert _report(epochs, ranks, 0, 1.0) == [None, None]  # epoch 0 closed: late, counted
    assert epochs.late == 2 and len(emitted) == 1

    _report(epochs, ranks, 1, math.nan)
    epochs.close_through(1, now=20.0, **close)  # type: ignore[arg-type]
    assert epochs.record_seqs == [101, 102]
    assert [alert[:2] for alert in raised] == [("nonfinite_loss", None)]

    assert epochs.new_attempt() == 1  # the last epoch the attempt closed; its own from here
    assert epochs.pending.last_closed == -1 and epochs.durations == []
    assert len(epochs.records) == 2  # records are the run's, kept across attempts

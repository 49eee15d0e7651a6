"""Per-rank state of a run: status and liveness, and each rank's latest resource sample with
its relabelled GPU entry (PROTOCOL.md 2.3, 3).

The samples are kept apart from the rest because they are pure cache:
``resources`` frames are nearly all the traffic, so storing one must stay O(1) with no
allocation (the decoded Struct is kept as is), while the dicts an epoch record and the
``ranks`` array need are built lazily, once per change, however many samples arrived since.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Tuple

from broker.run import aggregate
from broker.run.steps.closer import StepCloser
from rank_agent.protocol import ResourceSample

__all__ = ["RankState", "RankSamples", "ranks_array"]


class RankState:
    """Per-rank state. Plain slots: thousands of these are read at every close."""

    __slots__ = ("rank", "status", "last_seen", "epoch", "loss", "hardware", "sample_json",
                 "stalled", "collective", "error", "error_at")

    def __init__(self, rank: int, now: float) -> None:
        self.rank = rank
        self.status = "ok"  # ok | stale | finished | error
        self.last_seen = now
        self.epoch: int | None = None
        self.loss: float | None = None
        self.hardware: str | None = None
        self.sample_json: Dict[str, Any] | None = None  # cached dict of the latest sample
        #: a ``stall`` dump arrived after the rank's latest ``steps``/``metrics`` frame (and
        #: since this broker started): shown as ``stalled`` while the status is ``ok``
        self.stalled = False
        #: a ``collectives`` frame arrived after the rank's latest ``steps``/``metrics`` frame
        #: (and since this broker started): its latest one is current (section 7.2)
        self.collective = False
        #: the ``ErrorInfo`` of the rank's latest finish (None: it sent none; 8.2), as the
        #: run's :class:`broker.run.failure.ErrorStore` admitted it, and when the rank failed
        #: (its ``at``, or that finish's arrival: :func:`broker.run.failure.error_at`)
        self.error: Any = None
        self.error_at = 0.0

    @property
    def finished(self) -> bool:
        return self.status == "finished" or self.status == "error"


class RankSamples:
    """Latest sample per rank, plus the GPU entries an epoch record carries.

    ``place`` maps a rank to its ``(host, local_rank)`` (the topology's placement): a rank's
    GPU name carries it, so :meth:`placed` marks the rank for relabelling.
    """

    def __init__(self, place: Dict[int, Tuple[str, int]]) -> None:
        self._place = place
        #: rank -> latest sample (the decoded Struct, read-only)
        self.latest: Dict[int, ResourceSample] = {}
        # rank -> its first GPU relabelled for the record. Built lazily: a sample or a
        # register only marks the rank in ``_dirty`` (a resources frame stays O(1) with no
        # allocation), and a close rebuilds just the marked ranks, once however many samples
        # arrived since (the sampler usually sends several per epoch).
        self._gpus: Dict[int, Dict[str, Any]] = {}
        self._dirty: set[int] = set()
        self._labels: Dict[int, str] = {}  # rank -> its GPU name prefix (by placement)

    def put(self, rank: int, sample: ResourceSample) -> None:
        """Store ``rank``'s latest sample (last write wins)."""
        self.latest[rank] = sample
        self._dirty.add(rank)

    def placed(self, rank: int) -> None:
        """``rank``'s placement changed: its GPU name prefix is stale."""
        self._dirty.add(rank)
        self._labels.pop(rank, None)

    def discard(self, rank: int) -> None:
        """Forget everything about ``rank``."""
        self.latest.pop(rank, None)
        self._gpus.pop(rank, None)
        self._dirty.discard(rank)
        self._labels.pop(rank, None)

    def gpus(self) -> Dict[int, Dict[str, Any]]:
        """rank -> its relabelled first GPU, for every rank whose sample has one (shared;
        do not mutate). Rebuilds only the ranks marked since the last call."""
        dirty = self._dirty
        if dirty:
            self._refresh(dirty)
            dirty.clear()
        return self._gpus

    def _refresh(self, ranks: Iterable[int]) -> None:
        samples = self.latest
        gpus = self._gpus
        labels = self._labels
        place = self._place
        gpu_label: Callable[..., str] = aggregate.gpu_label
        rank_gpu = aggregate.rank_gpu
        for rank in ranks:
            sample = samples.get(rank)
            if sample is not None and sample.gpus:
                # The rank's name prefix is cached: it changes only with its placement.
                label = labels.get(rank)
                if label is None:
                    label = labels[rank] = gpu_label(rank, place.get(rank))
                gpus[rank] = rank_gpu(rank, None, sample.gpus[0], label)
            else:
                gpus.pop(rank, None)

    def json(self, rank: int) -> Dict[str, Any] | None:
        """``rank``'s latest sample as a JSON-ready dict (None: no sample). Not cached here:
        the sink caches it per rank until the next sample."""
        sample = self.latest.get(rank)
        return None if sample is None else aggregate.sample_dict(sample)


def ranks_array(ranks: Dict[int, RankState], place: Dict[int, Tuple[str, int]],
                samples: RankSamples, closer: StepCloser,
                xids: Dict[int, Dict[int, List[int]]] | None = None) -> List[Dict[str, Any]]:
    """The ``ranks`` array of PROTOCOL 4 (rank order), each entry plus its last ``loss`` and
    ``gpu_xids``.

    A rank's sample dict is cached on its :class:`RankState` until its next sample, so a
    ``ranks`` event every second re-encodes, but does not rebuild, an idle rank's sample.
    ``xids`` (:attr:`broker.run.gpualerts.GpuAlertRules.xids`) becomes each entry's
    ``gpu_xids``: ``[{"gpu", "count", "last"}]`` (XID events seen live since the broker
    started, and the latest code, per GPU), or null for a rank with none. A sample carries
    only the XIDs since the previous one, so ``/metrics`` needs the tally from here.
    """
    step_ranks = closer.ranks
    share = closer.share
    tallies = xids or {}
    out = []
    for rank in sorted(ranks):
        st = ranks[rank]
        p = place.get(rank)
        rs = step_ranks.get(rank)
        sample = st.sample_json
        if sample is None:
            sample = st.sample_json = samples.json(rank)
        out.append(
            {
                "rank": rank,
                "host": p[0] if p else None,
                "local_rank": p[1] if p else None,
                "status": "stalled" if st.stalled and st.status == "ok" else st.status,
                "last_seen": st.last_seen,
                "epoch": st.epoch,
                "hardware": st.hardware,
                "resources": sample,
                "step": rs.highest if rs is not None else None,
                "step_ms": rs.mean_ms() if rs is not None else None,
                "data_ms": rs.mean_data() if rs is not None else None,
                "slowest_share": share(rank),
                "loss": st.loss,
                "gpu_xids": _xids(tallies.get(rank)),
                "error": _error(st.error, st.error_at),  # 8.2
            }
        )
    return out


def _error(info: Any, at: float) -> Dict[str, Any] | None:
    """A rank's ``error`` in the ``ranks`` array (8.2): ``{type, at}`` or null."""
    return None if info is None else {"type": info.type, "at": at}


def _xids(tally: Dict[int, List[int]] | None) -> List[Dict[str, int]] | None:
    if not tally:
        return None
    return [{"gpu": gpu, "count": t[0], "last": t[1]} for gpu, t in sorted(tally.items())]

"""The GPU alert rules (PROTOCOL.md section 3, v3): pure, per run, fed every GPU sample.

A rank's samples carry the health fields of its GPUs (section 2). :class:`GpuAlertRules`
keeps, per (rank, ``device_index``), that GPU's previous sample and returns the alerts each
new sample raises, exactly by the contract's rules:

============== =====================================================================
kind           raised when
============== =====================================================================
gpu_xid        the sample lists any XID code (message: the codes and the GPU)
gpu_throttle   any of hw_slowdown, hw_thermal, hw_power_brake, sw_thermal is active in
               this sample **and** in the GPU's previous one; ``sw_power_cap`` alone is
               normal at full load and raises nothing
gpu_ecc        ``ecc_uncorrected`` is above the previous sample's, or above 0 in the
               GPU's first sample that has it
gpu_row_remap  ``remapped_rows_failed`` or ``remapped_rows_pending`` is true
gpu_pcie       ``pcie_link_width`` is below ``pcie_link_width_max`` in this sample and
               the previous one (one narrow reading can be a link retraining)
gpu_nvlink     ``nvlink_errors`` is above the previous sample's (a first sample raises
               nothing: the counters are cumulative since boot)
============== =====================================================================

A condition that persists raises again with every sample (the sink's alert keeps the time it
was last raised; webhook repeat suppression is per (run, kind, rank), in
:mod:`broker.webhooks.notifier`). "Previous" is the previous sample of the same GPU, from a
``resources`` frame or a ``metrics`` frame's ``resources`` alike; a field absent from either
sample breaks a two-sample rule. The sink feeds live frames only (a replay raises nothing);
what the rules compare with is carried across a restart instead (PROTOCOL 8.5):
:meth:`GpuAlertRules.state` keeps each GPU's cumulative counters (``ecc_uncorrected``,
``nvlink_errors``) and the XID tallies, written by the journal when an alert changed them
(:attr:`GpuAlertRules.changes`), and :meth:`GpuAlertRules.restore` makes them each GPU's
previous sample again, so an old ECC count raises nothing new. The two-sample rules
(throttle, PCIe) start afresh, as for a first sample: a condition that lasts raises again
with the second sample after the restart, as it would have anyway.

Cost: called for every sample the broker ingests. A GPU that sets no field the rules read
costs one test of those fields and is not remembered (issue 33: as a previous sample it is
the same as none); one with health fields and nothing to say costs a dict lookup and a
handful of attribute tests (no allocation); the previous sample is kept by reference
(decoded samples are immutable once stored). Per rank at most :data:`MAX_GPUS_PER_RANK`
GPUs are remembered, with their XID tallies, so a rank cannot grow the state (or the
``ranks`` event's ``gpu_xids``) without bound by inventing device indices.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Sequence

from rank_agent.protocol import GpuSample, ResourceSample

#: The clock event reasons that mean trouble; ``sw_power_cap`` is the normal state at full load.
BAD_THROTTLE = frozenset(("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal"))
_BAD_DISJOINT = BAD_THROTTLE.isdisjoint
#: GPUs remembered per rank (the wire allows 64 per sample).
MAX_GPUS_PER_RANK = 64

#: the kinds raised when a counter :meth:`GpuAlertRules.state` keeps moved (the others, a
#: persisting condition, are raised again with every sample and change nothing it keeps)
_COUNTED = frozenset(("gpu_xid", "gpu_ecc", "gpu_nvlink"))

class GpuAlert(NamedTuple):
    """One alert a sample raised: what the sink's ``_raise(kind, rank, message, now)`` takes."""

    kind: str
    rank: int
    message: str


class Sampled(NamedTuple):
    """A sample and the rank that sent it: one item of :meth:`GpuAlertRules.feed_many`
    (which a ``resources`` frame is too: it has ``rank`` and ``sample``)."""

    rank: int
    sample: ResourceSample


def _throttled(reasons: Sequence[str]) -> bool:
    return bool(reasons) and not BAD_THROTTLE.isdisjoint(reasons)


def _narrow(gpu: GpuSample) -> bool:
    width, widest = gpu.pcie_link_width, gpu.pcie_link_width_max
    return width is not None and widest is not None and width < widest


class GpuAlertRules:
    """The GPU alert state of one run: each GPU's previous sample, keyed by rank then index."""

    def __init__(self) -> None:
        self._prev: dict[int, dict[int, GpuSample]] = {}
        #: rank -> device index -> [XID events seen, the latest code]: what ``/metrics``
        #: exports as ``rankboard_gpu_xid_errors_total`` and ``rankboard_gpu_last_xid`` (a
        #: sample's XIDs are only those since the previous sample, so they must be tallied)
        self.xids: dict[int, dict[int, list[int]]] = {}
        #: samples that raised an XID, ECC or NVLink alert (what :meth:`state` keeps moved)
        self.changes = 0

    def feed(self, rank: int, sample: ResourceSample) -> list[GpuAlert]:
        """The alerts ``sample`` (from ``rank``) raises; remembers it as each GPU's previous."""
        return self.feed_many((Sampled(rank, sample),))

    def feed_many(self, items: Iterable[Any]) -> list[GpuAlert]:
        """:meth:`feed` for each of ``items`` in order (anything with ``rank`` and
        ``sample``: a batch's ``resources`` frames of a run, as they arrived): their alerts,
        in that order.

        One call for a batch because nearly every sample is quiet, and the test that says
        so is cheap: made per sample through the sink, the two calls around it cost a
        third of the broker's extra instructions over its rules written as one function,
        and two fifths of its extra cache misses (issue 17, BENCHMARKS.md's seventh pass).
        """
        out: list[GpuAlert] = []
        prev_of = self._prev
        for item in items:
            for gpu in item.sample.gpus:
                # One check first (issue 33): a GPU that sets none of the fields the rules
                # read (a v2 agent, a host without NVML's health queries: most samples of a
                # sampler flood) can raise nothing, and as the previous sample it is the
                # same as none, since every two-sample rule needs its field in both (a
                # width without a maximum, or the reverse, is never narrow). So it is not
                # remembered: its GPU's older sample, if any, is forgotten instead.
                if not (gpu.xid_errors or gpu.throttle_reasons
                        or gpu.ecc_uncorrected is not None or gpu.nvlink_errors is not None
                        or gpu.pcie_link_width is not None
                        or gpu.remapped_rows_pending is not None
                        or gpu.remapped_rows_failed is not None):
                    if prev_of:
                        known = prev_of.get(item.rank)
                        if known:
                            known.pop(gpu.device_index, None)
                    continue
                rank = item.rank
                known = prev_of.get(rank)
                if known is None:
                    known = prev_of[rank] = {}
                index = gpu.device_index
                prev = known.get(index)
                if prev is None and len(known) >= MAX_GPUS_PER_RANK:
                    self._drop_gpu(rank, known)  # the GPU remembered longest goes
                known[index] = gpu
                # the quiet case, inline (nearly every sample): nothing below can fire
                ecc = gpu.ecc_uncorrected
                nvlink = gpu.nvlink_errors
                width = gpu.pcie_link_width
                reasons = gpu.throttle_reasons
                if not (gpu.xid_errors or gpu.remapped_rows_failed or gpu.remapped_rows_pending
                        or (reasons and not _BAD_DISJOINT(reasons))
                        or (width is not None and gpu.pcie_link_width_max is not None
                            and width < gpu.pcie_link_width_max)
                        or (ecc and (prev is None or prev.ecc_uncorrected is None
                                     or ecc > prev.ecc_uncorrected))
                        or (nvlink is not None and prev is not None
                            and prev.nvlink_errors is not None
                            and nvlink > prev.nvlink_errors)):
                    continue
                found = self._check(rank, gpu, prev)
                if found:
                    if not _COUNTED.isdisjoint([a.kind for a in found]):
                        self.changes += 1  # an XID tally or a counter moved
                    out.extend(found)
        return out

    def _check(self, rank: int, gpu: GpuSample, prev: GpuSample | None) -> list[GpuAlert] | None:
        out: list[GpuAlert] | None = None
        if gpu.xid_errors:
            tally = self.xids.setdefault(rank, {}).setdefault(gpu.device_index, [0, 0])
            tally[0] += len(gpu.xid_errors)
            tally[1] = gpu.xid_errors[-1]
            codes = ", ".join(str(c) for c in gpu.xid_errors)
            out = [GpuAlert("gpu_xid", rank, f"XID {codes} on GPU {gpu.device_index}")]
        reasons = gpu.throttle_reasons
        if reasons and prev is not None and _throttled(reasons) and _throttled(prev.throttle_reasons):
            bad = ", ".join(r for r in reasons if r in BAD_THROTTLE)
            sm = gpu.sm_clock_mhz
            clock = f" (SM {sm:.0f} MHz)" if sm is not None and math.isfinite(sm) else ""
            out = out or []
            out.append(GpuAlert("gpu_throttle", rank, f"{bad} throttling on GPU {gpu.device_index}{clock}"))
        ecc = gpu.ecc_uncorrected
        if ecc is not None:
            before = prev.ecc_uncorrected if prev is not None else None
            if (before is None and ecc > 0) or (before is not None and ecc > before):
                out = out or []
                out.append(GpuAlert("gpu_ecc", rank, f"{ecc} uncorrected ECC errors on GPU {gpu.device_index}"))
        if gpu.remapped_rows_failed or gpu.remapped_rows_pending:
            what = "row remapping failed" if gpu.remapped_rows_failed else "row remapping pending"
            out = out or []
            out.append(GpuAlert("gpu_row_remap", rank, f"{what} on GPU {gpu.device_index}"))
        if prev is not None and _narrow(gpu) and _narrow(prev):
            gen = ""
            if gpu.pcie_link_gen is not None and gpu.pcie_link_gen_max is not None:
                gen = f", gen {gpu.pcie_link_gen} of {gpu.pcie_link_gen_max}"
            out = out or []
            out.append(GpuAlert("gpu_pcie", rank, f"PCIe link x{gpu.pcie_link_width} of "
                                                  f"x{gpu.pcie_link_width_max} on GPU {gpu.device_index}{gen}"))
        nvlink = gpu.nvlink_errors
        if nvlink is not None and prev is not None:
            before = prev.nvlink_errors
            if before is not None and nvlink > before:
                out = out or []
                out.append(GpuAlert("gpu_nvlink", rank, f"{nvlink - before} new NVLink errors "
                                                        f"(total {nvlink}) on GPU {gpu.device_index}"))
        return out

    def _drop_gpu(self, rank: int, known: dict[int, GpuSample]) -> None:
        """Forget the rank's GPU remembered longest, and its XID tally with it: a rank's
        tallies stay within the GPUs it is remembered with (issue 32, finding 3: a rank
        inventing device indices grew the tally, and the ``ranks`` event, without bound)."""
        index = next(iter(known))
        del known[index]
        tallies = self.xids.get(rank)
        if tallies is not None:
            tallies.pop(index, None)

    def state(self) -> dict[str, Any]:
        """What the rules compare with, as plain data for the journal: ``prev`` as ``[rank,
        device_index, ecc_uncorrected, nvlink_errors]`` for each remembered GPU that has
        either counter, ``xids`` as ``[rank, device_index, count, last]``."""
        prev = [[rank, index, gpu.ecc_uncorrected, gpu.nvlink_errors]
                for rank, known in self._prev.items() for index, gpu in known.items()
                if gpu.ecc_uncorrected is not None or gpu.nvlink_errors is not None]
        xids = [[rank, index, t[0], t[1]]
                for rank, tallies in self.xids.items() for index, t in tallies.items()]
        return {"prev": prev, "xids": xids}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state` wrote (after a restart): each GPU's counters become
        its previous sample (the fields the two-sample rules read are absent, as before a
        first sample). Raises ``ValueError``/``TypeError`` for data it cannot take, leaving
        the rules as they were."""
        prev: dict[int, dict[int, GpuSample]] = {}
        for rank, index, ecc, nvlink in state["prev"]:
            known = prev.setdefault(int(rank), {})
            if len(known) < MAX_GPUS_PER_RANK:
                known[int(index)] = GpuSample(
                    device_index=int(index), name="",
                    ecc_uncorrected=None if ecc is None else int(ecc),
                    nvlink_errors=None if nvlink is None else int(nvlink))
        xids: dict[int, dict[int, list[int]]] = {}
        for rank, index, count, last in state["xids"]:
            tallies = xids.setdefault(int(rank), {})
            if len(tallies) < MAX_GPUS_PER_RANK:
                tallies[int(index)] = [int(count), int(last)]
        self._prev, self.xids = prev, xids

    def forget(self, rank: int) -> None:
        """Drop a rank's GPUs (a rank discarded for being past the run's world size)."""
        self._prev.pop(rank, None)
        self.xids.pop(rank, None)

    def forget_from(self, world_size: int) -> None:
        """Drop every rank ``>= world_size`` (the run's world size just became known)."""
        for rank in [r for r in self._prev if r >= world_size]:
            del self._prev[rank]
        for rank in [r for r in self.xids if r >= world_size]:
            del self.xids[rank]

    def __len__(self) -> int:
        """GPUs remembered (for tests and memory accounting)."""
        return sum(len(v) for v in self._prev.values())

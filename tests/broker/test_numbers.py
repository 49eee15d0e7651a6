"""Numbers that go wrong, per rank (PROTOCOL.md 8.3), at the wire: frames encoded as a rank
sends them, through ``Runs.ingest`` (decode, limits, the sink's rules), with a fake clock.

The first non-finite value of each metric with the ranks that had one at that step (ranks
sending out of order, ``inf``/``-inf``, a second metric, the 64-entry bound, a run-wide
NaN), and replicas that disagree (one odd rank, two odd ranks and no majority, a rounding
difference that is no divergence, a non-finite replicated value left to the non-finite
rule). The majority rule itself is a pure function with tests of its own.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pytest

from broker.run.steps.numbers import majority
from broker.runs import Runs
from rank_agent import protocol

RUN = "numbers-run"
T0 = 1_000.0


def raw(frame: dict[str, Any]) -> bytes:
    """A frame as a rank's agent puts it on the wire (MessagePack of a map)."""
    return protocol.encoder.encode({"run": RUN, **frame})


def register(rank: int, ws: int, host: str = "node-a", **kw: Any) -> bytes:
    return raw({"type": "register", "rank": rank, "world_size": ws, "host": host, **kw})


def point(rank: int, step: int, **metrics: Optional[float]) -> bytes:
    return raw({"type": "steps", "rank": rank, "steps": [step], "times": [T0 + step],
                "step_ms": [100.0], "metrics": {n: [v] for n, v in metrics.items()}})


class Wire:
    """A ``Runs`` fed wire bytes at a fake time; ``header()`` after a tick (which closes
    what the watermark allows and publishes the steps, raising their alerts)."""

    def __init__(self, ws: int, *, replicated: Optional[list[str]] = None,
                 hosts: Optional[list[str]] = None) -> None:
        self.runs = Runs(step_close_after=1000.0)
        self.t = T0
        self.ws = ws
        for r in range(ws):
            host = hosts[r] if hosts else "node-a"
            extra = {"replicated": replicated} if replicated and r == 0 else {}
            self.send(register(r, ws, host, **extra))

    def send(self, data: bytes) -> None:
        self.t += 0.001  # (a step of 200 ranks arrives within the start-up grace)
        self.runs.ingest(data, self.t)

    def step(self, step: int, values: dict[str, list[Optional[float]]],
             order: Optional[list[int]] = None) -> None:
        """Every rank's point of ``step`` (``values[name][rank]``; None: not logged)."""
        for r in order if order is not None else range(self.ws):
            self.send(point(r, step, **{n: v[r] for n, v in values.items()}))

    def header(self) -> dict[str, Any]:
        self.t += 2.0  # past the start-up grace and the steps event interval
        sink = self.runs.get(RUN)
        assert sink is not None
        sink.tick(self.t)
        return sink.header()

    def alerts(self, kind: str) -> list[tuple[Optional[int], str]]:
        return [(a["rank"], a["message"]) for a in self.header()["alerts"] if a["kind"] == kind]


NAN, INF = math.nan, math.inf


# ---------------------------------------------------------------- the majority rule (pure)


def test_majority_one_odd_rank() -> None:
    maj, odd = majority(np.arange(4), np.array([2.0, 2.0, 9.0, 2.0]))
    assert maj == 2.0 and odd.tolist() == [False, False, True, False]


def test_majority_two_odd_ranks_of_four_is_no_majority() -> None:
    maj, odd = majority(np.arange(4), np.array([2.0, 2.0, 3.0, 4.0]))
    assert maj is None and odd.all()  # 2.0 has two of four: not more than half


def test_majority_rounding_is_within_the_tolerance() -> None:
    v = 1.2345678
    maj, odd = majority(np.arange(3), np.array([v, v * (1 + 1e-12), v]))
    assert maj == v and not odd.any()


def test_majority_is_the_most_common_exact_value_ties_to_the_lowest_rank() -> None:
    # all within 1e-6 of each other: everyone agrees; the majority reported is the value
    # held by most ranks exactly (ranks 1 and 2), not rank 0's
    a, b = 5.0, 5.0 * (1 + 1e-9)
    maj, odd = majority(np.array([0, 1, 2]), np.array([a, b, b]))
    assert maj == b and not odd.any()
    maj, _ = majority(np.array([7, 3]), np.array([a, b]))  # a tie: rank 3's value
    assert maj == b


def test_majority_over_many_distinct_values_stays_bounded() -> None:
    rng = np.random.default_rng(1)
    values = np.concatenate([np.full(3000, 1.0), rng.uniform(2, 3, 2000)])
    maj, odd = majority(np.arange(5000), values)
    assert maj == 1.0 and int(odd.sum()) == 2000


# ---------------------------------------------------------------- first non-finite


def test_first_nan_names_the_lowest_rank_of_its_step_whatever_order_ranks_send() -> None:
    w = Wire(8)
    for s in range(3):
        w.step(s, {"loss": [1.0] * 8}, order=[7, 3, 0, 5, 1, 6, 2, 4])
    bad: list[Optional[float]] = [1.0] * 8
    bad[6], bad[2], bad[5] = NAN, NAN, NAN
    w.step(3, {"loss": bad}, order=[6, 7, 5, 4, 3, 2, 1, 0])
    w.step(4, {"loss": [NAN] * 8}, order=list(range(7, -1, -1)))  # spread: not "first"
    h = w.header()
    assert h["nonfinite"] == [{"metric": "loss", "step": 3, "rank": 2, "host": "node-a",
                               "ranks": [2, 5, 6], "attempt": 0}]
    assert h["nonfinite_more"] == 0
    assert w.alerts("nonfinite") == [
        (2, "loss is nan at step 3: first non-finite loss (3 ranks)")]


def test_inf_and_minus_inf_and_a_second_metric() -> None:
    w = Wire(4)
    w.step(0, {"loss": [1.0] * 4, "grad_norm": [1.0] * 4})
    w.step(1, {"loss": [1.0, 1.0, INF, 1.0], "grad_norm": [1.0] * 4})
    w.step(2, {"loss": [NAN] * 4, "grad_norm": [1.0, -INF, 1.0, 1.0]})
    h = w.header()
    assert [(e["metric"], e["step"], e["rank"], e["ranks"]) for e in h["nonfinite"]] == [
        ("loss", 1, 2, [2]), ("grad_norm", 2, 1, [1])]
    assert sorted(w.alerts("nonfinite")) == [
        (1, "grad_norm is -inf at step 2: first non-finite grad_norm (1 rank)"),
        (2, "loss is inf at step 1: first non-finite loss (1 rank)")]


def test_metrics_first_bad_at_one_step_are_listed_by_name() -> None:
    w = Wire(2)
    w.step(0, {"b": [NAN, 1.0], "a": [1.0, INF]})
    assert [(e["metric"], e["rank"]) for e in w.header()["nonfinite"]] == [("a", 1), ("b", 0)]


def test_nan_on_more_than_half_the_world_is_run_wide_and_half_is_not() -> None:
    w = Wire(4)
    w.step(0, {"loss": [NAN, NAN, 1.0, 1.0], "x": [NAN, NAN, NAN, 1.0]})
    assert sorted(w.alerts("nonfinite"), key=str) == sorted([
        (0, "loss is nan at step 0: first non-finite loss (2 ranks)"),
        (None, "x is nan at step 0: first non-finite x (3 ranks)")], key=str)


def test_entries_are_bounded_at_64_and_later_metrics_counted() -> None:
    w = Wire(2)
    for s in range(3):  # 3 steps x 30 metrics, each first non-finite at its step
        w.step(s, {f"m{s:02d}_{i:02d}": [NAN, 1.0] for i in range(30)})
    w.step(3, {"m00_00": [NAN, NAN]})  # an entry's metric again: nothing new
    h = w.header()
    assert len(h["nonfinite"]) == 64 and h["nonfinite_more"] == 26
    assert h["nonfinite"][0]["metric"] == "m00_00" and h["nonfinite"][-1]["metric"] == "m02_03"


def test_ranks_listed_are_the_lowest_64_and_the_message_counts_them_all() -> None:
    w = Wire(200)
    w.step(0, {"loss": [NAN if r % 2 else 1.0 for r in range(200)]})
    e = w.header()["nonfinite"][0]
    assert e["ranks"] == list(range(1, 129, 2)) and e["rank"] == 1
    assert w.alerts("nonfinite") == [(1, "loss is nan at step 0: first non-finite loss (100 ranks)")]


def test_a_step_with_only_finite_values_lists_nothing() -> None:
    w = Wire(3)
    for s in range(5):
        w.step(s, {"loss": [1e308, 1e308, 1.0]})
    h = w.header()
    assert h["nonfinite"] == [] and h["nonfinite_more"] == 0 and h["replica_divergence"] == []


# ---------------------------------------------------------------- replicas that disagree


def test_one_odd_replica() -> None:
    w = Wire(4, replicated=["grad_norm"], hosts=["node-a", "node-a", "node-c", "node-c"])
    for s in range(5):
        w.step(s, {"grad_norm": [2.5, 2.5, 2.5 if s < 2 else 2.75, 2.5], "loss": [1.0, 2.0, 3.0, 4.0]})
    h = w.header()
    assert h["replica_divergence"] == [{"metric": "grad_norm", "first_step": 2, "last_step": 4,
                                        "count": 3, "ranks": [2], "majority": 2.5}]
    assert w.alerts("replica_divergence") == [
        (2, "grad_norm = 2.75 at step 2, the majority of 4 ranks has 2.5")]
    assert h["nonfinite"] == []  # and loss, different on every rank, is not replicated


def test_two_odd_replicas_of_four_is_no_majority() -> None:
    w = Wire(4, replicated=["checksum"])
    w.step(0, {"checksum": [7.0, 7.0, 7.0, 7.0]})
    w.step(1, {"checksum": [7.0, 8.0, 7.0, 9.0]})
    w.step(2, {"checksum": [7.0, 7.0, 7.0, 9.0]})  # later steps change neither entry nor alert
    h = w.header()
    assert h["replica_divergence"] == [{"metric": "checksum", "first_step": 1, "last_step": 2,
                                        "count": 2, "ranks": [0, 1, 2, 3], "majority": None}]
    assert sorted(w.alerts("replica_divergence")) == [
        (0, "checksum = 7 at step 1, no majority among 4 ranks"),
        (1, "checksum = 8 at step 1, no majority among 4 ranks"),
        (2, "checksum = 7 at step 1, no majority among 4 ranks"),
        (3, "checksum = 9 at step 1, no majority among 4 ranks")]


def test_a_rounding_difference_is_not_a_divergence() -> None:
    w = Wire(4, replicated=["grad_norm"])
    v = 3.14159
    for s in range(3):
        w.step(s, {"grad_norm": [v, v * (1 + 1e-12), v, v * (1 - 1e-12)]})
    h = w.header()
    assert h["replica_divergence"] == [] and w.alerts("replica_divergence") == []


def test_a_non_finite_replicated_value_goes_to_the_non_finite_rule_only() -> None:
    w = Wire(4, replicated=["grad_norm"])
    w.step(0, {"grad_norm": [1.0, 1.0, 1.0, 1.0]})
    w.step(1, {"grad_norm": [1.0, 1.0, NAN, 1.0]})
    w.step(2, {"grad_norm": [1.0, INF, 1.0, 1.0]})
    h = w.header()
    assert h["replica_divergence"] == [] and w.alerts("replica_divergence") == []
    assert [(e["metric"], e["step"], e["ranks"]) for e in h["nonfinite"]] == [
        ("grad_norm", 1, [2])]


def test_replicated_set_is_the_union_of_registers_lists() -> None:
    w = Wire(3)
    w.send(register(1, 3, replicated=["a"]))
    w.send(register(2, 3, replicated=["b", "a"]))
    w.step(0, {"a": [1.0, 1.0, 5.0], "b": [1.0, 6.0, 1.0], "c": [1.0, 2.0, 3.0]})
    assert [e["metric"] for e in w.header()["replica_divergence"]] == ["a", "b"]


@pytest.mark.parametrize("replicated", [[f"m{i}" for i in range(65)], ["x" * 129], [3]],
                         ids=["65_names", "long_name", "not_a_string"])
def test_register_over_the_replicated_bounds_is_rejected_as_schema(replicated: Any) -> None:
    runs = Runs()
    assert runs.ingest(register(0, 2, replicated=replicated), T0) == []
    assert runs.rejected == {"schema": 1} and len(runs) == 0
    runs.ingest(register(0, 2, replicated=[f"m{i}" for i in range(64)]), T0)
    assert runs.accepted == 1


# ---------------------------------------------------------------- the ranks' values at a close


@pytest.mark.parametrize("sparse", [False, True], ids=["every_value", "some_missing"])
def test_both_closes_give_every_ranks_value_at_a_step(sparse: bool) -> None:
    """The grid close (one frame a rank, the live case) and the general one (sorting by step
    and rank) hand the number rules the same (rank, value) pairs."""
    from broker.run.steps.columns import FrameBuffer, close_columns
    from rank_agent.protocol import Steps

    def frames() -> list[Steps]:
        out = []
        for r in (5, 0, 3, 1):  # arrival order is not rank order
            vals = {"a": [float(r), 10.0 + r], "b": [None if sparse and r == 3 else -r, NAN]}
            out.append(Steps(run=RUN, rank=r, steps=[7, 8], times=[1.0, 2.0],
                             step_ms=[1.0, 1.0], metrics=vals))  # type: ignore[arg-type]
        return out

    grid, general = FrameBuffer(), FrameBuffer()
    for f in frames():
        grid.add(f, True)
        general.add(f, True)
    fast = grid.close_grid()
    slow = close_columns(general.take())
    assert fast is not None and slow is not None
    for batch in (fast, slow):
        got = {}
        for j in range(len(batch.metric_name)):
            ranks, values = batch.values_at(j)
            key = (batch.names[int(batch.metric_name[j])], int(batch.step[batch.metric_idx[j]]))
            got[key] = sorted(zip(ranks.tolist(), [None if math.isnan(v) else v
                                                   for v in values.tolist()]))
        b7 = [(0, -0.0), (1, -1.0), (5, -5.0)] + ([] if sparse else [(3, -3.0)])
        assert got == {("a", 7): [(0, 0.0), (1, 1.0), (3, 3.0), (5, 5.0)],
                       ("a", 8): [(0, 10.0), (1, 11.0), (3, 13.0), (5, 15.0)],
                       ("b", 7): sorted(b7),
                       ("b", 8): [(0, None), (1, None), (3, None), (5, None)]}
        batch.drop_raw()
        assert len(batch.values_at(0)[0]) == 0


def test_a_new_attempt_has_first_values_of_its_own_and_keeps_the_listed_ones() -> None:
    w = Wire(2, replicated=["gn"])
    w.step(0, {"loss": [NAN, 1.0], "gn": [1.0, 2.0]})
    sink = w.runs.get(RUN)
    assert sink is not None
    sink._steps.numbers.new_attempt(1)  # (8.1 will call it; the rules are keyed for it)
    w.step(1, {"loss": [1.0, NAN], "gn": [1.0, 1.0]})
    w.step(2, {"loss": [1.0, 1.0], "gn": [5.0, 1.0]})
    h = w.header()
    assert [(e["step"], e["rank"], e["attempt"]) for e in h["nonfinite"]] == [(0, 0, 0), (1, 1, 1)]
    assert [(e["first_step"], e["count"]) for e in h["replica_divergence"]] == [(2, 1)]


def test_a_journal_state_that_is_not_what_it_should_be_loads_nothing_and_breaks_nothing() -> None:
    from broker.run.steps.numbers import RunNumbers

    numbers = RunNumbers()
    numbers.restore({"nonfinite": "junk", "first": [[0]], "raised": 3})
    assert numbers.nonfinite == [] and numbers.divergence == {}
    w = Wire(2)
    w.step(0, {"loss": [NAN, 1.0]})
    assert len(w.header()["nonfinite"]) == 1


def test_the_journal_writes_the_ranks_lists_only_when_they_grow() -> None:
    w = Wire(4, replicated=["gn"])
    sink = w.runs.get(RUN)
    assert sink is not None
    w.step(0, {"gn": [1.0, 1.0, 9.0, 1.0]})
    w.header()
    first = sink.numbers_wire()
    assert first is not None and first["raised"] == {"gn": [2]}
    assert first["messages"] == {2: "gn = 9 at step 0, the majority of 4 ranks has 1"}
    assert sink.numbers_wire() is None  # nothing changed since
    w.step(1, {"gn": [1.0, 1.0, 9.0, 1.0]})  # the same rank again: the count moves
    w.header()
    again = sink.numbers_wire()
    assert again is not None and "raised" not in again and "messages" not in again
    assert again["divergence"][0]["count"] == 2
    # a reload takes both: the lists of the first, the count of the second
    from broker.run.steps.numbers import RunNumbers

    restored = RunNumbers()
    restored.restore(first)
    restored.restore(again)
    assert restored.wire()["raised"] == {"gn": [2]} and restored.divergence["gn"]["count"] == 2


def test_majority_past_the_pairwise_limit_agrees_with_the_pairwise_rule() -> None:
    from broker.run.steps import numbers as nmod

    rng = np.random.default_rng(7)
    for case in range(20):
        base = rng.choice([-3.0, 1e-3, 2.5, 1e9])
        # values clustered around base at distances around the tolerance, some far off
        spread = rng.choice([1e-8, 5e-7, 2e-6], size=1500)
        values = base * (1 + spread * rng.uniform(-1, 1, 1500))
        values[rng.integers(0, 1500, 40)] = base * 3
        ranks = np.arange(1500)
        limit = nmod.PAIRWISE_LIMIT
        try:
            nmod.PAIRWISE_LIMIT = 10**6
            want = nmod.majority(ranks, values)
        finally:
            nmod.PAIRWISE_LIMIT = limit
        got = nmod.majority(ranks, values)
        assert got[0] == want[0] and (got[1] == want[1]).all(), case


def test_steps_closed_together_name_the_earliest() -> None:
    w = Wire(3)
    for r in (2, 1, 0):  # ten steps a frame: they close in one batch
        loss = [NAN if (r == 1 and s >= 4) or (r == 0 and s >= 7) else 1.0 for s in range(10)]
        gn = [INF if (r == 2 and s == 8) else 1.0 for s in range(10)]
        w.send(raw({"type": "steps", "rank": r, "steps": list(range(10)),
                    "times": [T0 + s for s in range(10)], "step_ms": [1.0] * 10,
                    "metrics": {"loss": loss, "gn": gn}}))
    assert [(e["metric"], e["step"], e["ranks"]) for e in w.header()["nonfinite"]] == [
        ("loss", 4, [1]), ("gn", 8, [2])]

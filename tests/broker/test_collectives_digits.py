"""Issue 38, item 4: a ``collectives`` group id of Unicode digits (``"²"``: ``str.isdigit()``
is true, ``int()`` refuses it) and, more generally, one frame the verdict cannot read, must
not freeze a run's verdict or make the run's later frames fail.

Before: ``pg_order`` asked ``isdigit()`` then called ``int()``; the frame was kept before the
verdict ran, and every later frame reran the verdict over every kept frame, so each failed
as ``internal`` (not journaled) and the verdict stayed on its last culprit."""
from __future__ import annotations

import logging

import pytest

from broker.runs import Runs
from broker.stacks.collectives import pg_order
from broker.stacks.feed import STACKS_INTERVAL
from rank_agent import protocol
from rank_agent.digits import ascii_int, is_ascii_digits
from rank_agent.flightrec import _pg_order
from rank_agent.protocol import CollectiveEntry, Collectives, ProcessGroupStatus, Register

RUN = "digits-run"
WS = 4


def frame(rank: int, groups: dict[str, int]) -> bytes:
    """``rank``'s collectives frame: each group ``pg`` enqueued up to ``seq`` (completed one
    less), with an ``all_reduce`` entry at that seq."""
    return protocol.encoder.encode(Collectives(
        run=RUN, rank=rank, reason="stall", taken_at=100.0 + rank,
        groups=[ProcessGroupStatus(pg=pg, desc="d", size=WS, last_enqueued=seq,
                                   last_completed=seq - 1) for pg, seq in groups.items()],
        entries=[CollectiveEntry(pg=pg, seq=seq, op="gloo:all_reduce", input_sizes=[[4]])
                 for pg, seq in groups.items()]))


def started() -> tuple[Runs, float]:
    runs = Runs()
    now = 1_800_000_000.0
    for r in range(WS):
        runs.ingest(protocol.encoder.encode(Register(run=RUN, rank=r, world_size=WS,
                                                     host=f"h{r}")), now)
    return runs, now


def verdict(runs: Runs) -> list[dict]:
    (snap,) = runs.snapshot(RUN)
    return snap["collectives"]["groups"]


@pytest.mark.parametrize("text", ["²", "٣", "1_0", " 7", "+1", "-1", "", "0x1", "1" * 19])
def test_one_notion_of_a_number_refuses_what_is_not_ascii_digits(text: str) -> None:
    assert not is_ascii_digits(text) or len(text) > 18
    assert ascii_int(text, 18) is None
    assert pg_order(text) == (1, 0, text) == _pg_order(text)


def test_ascii_digits_are_numbers_in_numeric_order() -> None:
    assert ascii_int("017") == 17 and ascii_int("9" * 18, 18) == 10**18 - 1
    assert sorted(["10", "²", "2", "a"], key=pg_order) == ["2", "10", "a", "²"]


def test_a_group_id_of_unicode_digits_neither_freezes_the_verdict_nor_fails_later_frames(
        caplog: pytest.LogCaptureFixture) -> None:
    """Rank 3 is behind in group "0"; rank 1 also reports a group "²". The verdict names
    rank 3; later frames (rank 3 catching up, then rank 0 behind) are applied, none
    ``internal``, and the verdict follows them."""
    runs, now = started()
    for r in range(WS):
        groups = {"0": 7 if r != 3 else 6}
        if r == 1:
            groups["²"] = 3
        runs.ingest(frame(r, groups), now)
    runs.tick(now + STACKS_INTERVAL)
    (g0,) = [g for g in verdict(runs) if g["pg"] == "0"]
    assert [b["rank"] for b in g0["behind"]] == [3]
    now += 2 * STACKS_INTERVAL
    runs.ingest(frame(3, {"0": 7}), now)
    runs.ingest(frame(0, {"0": 6}), now)
    for r in (1, 2, 3):
        runs.ingest(frame(r, {"0": 8}), now)
    runs.tick(now + STACKS_INTERVAL)
    assert "internal" not in runs.rejected
    (g0,) = [g for g in verdict(runs) if g["pg"] == "0"]
    assert [b["rank"] for b in g0["behind"]] == [0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_kept_frame_the_verdict_cannot_read_is_dropped_not_left_to_fail_every_later_one(
        caplog: pytest.LogCaptureFixture) -> None:
    """The guard behind the fix: a frame whose digest the verdict cannot read (here one in
    wire form with a text sequence number, as no validated frame has: a stand-in for the
    next such bug) is dropped with the others kept since the last ``stacks`` event (the
    suspects), the web is told its rank has none, and the frames after it are applied and
    judged; the frames of earlier events stay."""
    caplog.set_level(logging.CRITICAL)
    runs, now = started()
    sink = runs.get(RUN)
    assert sink is not None
    for r in (0, 1):
        runs.ingest(frame(r, {"0": 7}), now)
    now += STACKS_INTERVAL
    runs.tick(now)  # their stacks event: they are no longer the newest
    bad = {"rank": 2, "reason": "stall", "request_id": "", "taken_at": 1.0,
           "groups": [{"pg": "0", "desc": "", "size": WS, "last_enqueued": "7",
                       "last_completed": 6}], "entries": []}
    assert sink._stack_feed.collectives.put_wire(bad, RUN)
    sink._stack_feed.coll_pending[(2, "stall")] = None
    sink._stack_feed.coll_changed = True
    sink._ranks[2].collective = True
    for step in range(3):  # each later frame applied, the verdict judged without rank 2's
        now += 2 * STACKS_INTERVAL
        runs.ingest(frame(3, {"0": 6 + step}), now)
        runs.tick(now)
        assert "internal" not in runs.rejected
    (g0,) = [g for g in verdict(runs) if g["pg"] == "0"]
    assert g0["seq"] == 8 and [b["rank"] for b in g0["behind"]] == [0, 1]
    assert (2, "stall") not in sink._stack_feed.collectives

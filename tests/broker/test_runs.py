"""Runs: decode + reject counting + run cap, in memory (no sockets); and RateLimitedLog."""
from __future__ import annotations

import logging

import msgspec
import pytest

from broker.run.events import Event
from broker.runs import Runs
from rank_agent import protocol
from rank_agent.protocol import Svg
from rank_agent.ratelimit import RateLimitedLog
from tests.support.frames import bad_metadata, enc, finish, metrics, register

T0 = 1_000_000.0


def kinds(events: list) -> list[str]:
    return [ev.kind for _, ev in events]


# -- decode-level rejects --------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xc1", "decode"),  # never-used MessagePack opcode
        (b"\xda\xff", "decode"),  # a str header cut short
        (enc(register())[:-3], "decode"),  # truncated
        (b"", "decode"),
        (enc({"type": "bogus", "run": "r1", "rank": 0}), "schema"),  # unknown tag
        (enc({"run": "r1", "rank": 0, "world_size": 1, "host": "h"}), "schema"),  # no tag
        (enc({"type": "register", "run": "r1", "rank": "zero", "world_size": 1, "host": "h"}),
         "schema"),  # wrong type
        (enc({"type": "register", "run": "r1", "rank": 0, "host": "h"}), "schema"),  # missing
        (enc({"type": "register", "run": "bad run!", "rank": 0, "world_size": 1, "host": "h"}),
         "schema"),  # run id pattern
        (enc({"type": "metrics", "run": "r1", "rank": -1, "epoch": 0, "avg_loss": 1.0}),
         "schema"),  # constraint
        (enc([1, 2, 3]), "schema"),  # valid msgpack, not a map
        (b"\x00" * (protocol.MAX_FRAME_BYTES + 1), "oversize"),
        (enc(Svg(run="r1", rank=0, svg="\u00e9" * (protocol.MAX_SVG_BYTES // 2 + 1))), "limit"),
    ],
)
def test_bad_frame_is_counted_by_reason_and_has_no_effect(raw: bytes, reason: str) -> None:
    runs = Runs()
    assert runs.ingest(raw, T0) == []
    assert runs.rejected == {reason: 1}
    assert runs.accepted == 0
    assert len(runs) == 0


@pytest.mark.parametrize("run", ["r1\n", "r1\n\n", ".", "..", "...", "", "x" * 129, "r\u00e91"])
def test_run_id_is_matched_whole_and_not_dots_only(run: str) -> None:
    """Contract v3: a trailing newline does not slip through (``$`` would let it), and a run
    named ``.``/``..`` (no file, no URL path segment can name it) is no run id."""
    assert not protocol.valid_run_id(run)
    runs = Runs()
    assert runs.ingest(enc({"type": "register", "run": run, "rank": 0, "world_size": 1,
                            "host": "h"}), T0) == []
    assert runs.rejected == {"schema": 1}
    assert len(runs) == 0


@pytest.mark.parametrize("run", ["r1", ".a", "a.", "a..b", "._:-", "x" * 128])
def test_run_ids_with_dots_among_other_characters_pass(run: str) -> None:
    assert protocol.valid_run_id(run)
    runs = Runs()
    runs.ingest(enc({"type": "register", "run": run, "rank": 0, "world_size": 1, "host": "h"}),
                T0)
    assert runs.rejected == {} and run in runs


def test_validation_error_is_schema_not_decode() -> None:
    # ValidationError subclasses DecodeError: the order of the excepts matters.
    assert issubclass(msgspec.ValidationError, msgspec.DecodeError)
    runs = Runs()
    runs.ingest(enc({"type": "finish", "run": "r1", "rank": 0, "status": "maybe"}), T0)
    assert runs.rejected == {"schema": 1}


def test_unknown_extra_keys_are_ignored() -> None:
    runs = Runs()
    raw = enc({"type": "register", "run": "r1", "rank": 0, "world_size": 1, "host": "h",
               "future_field": [1, 2]})
    assert kinds(runs.ingest(raw, T0)) == ["run"]
    assert runs.accepted == 1 and not runs.rejected


def test_valid_frames_around_bad_ones_are_applied() -> None:
    runs = Runs()
    out = []
    stream = [enc(register(world_size=2, rank=0)), b"\xc1", enc(register(world_size=2, rank=1)),
              enc({"type": "nope"}), enc(metrics(rank=0)), b"\x00" * (protocol.MAX_FRAME_BYTES + 1),
              enc(metrics(rank=1))]
    for raw in stream:
        out.extend(runs.ingest(raw, T0))
    assert runs.accepted == 4
    assert runs.rejected == {"decode": 1, "schema": 1, "oversize": 1}
    assert "epoch" in kinds(out)
    sink = runs.get("r1")
    assert sink is not None and len(sink.records) == 1
    assert all(run == "r1" for run, _ in out)
    seqs = [ev.seq for _, ev in out]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


# -- sink-level rejects --------------------------------------------------------------------


def test_rejected_first_frame_creates_no_run() -> None:
    runs = Runs()
    assert runs.ingest(enc(bad_metadata(run="fresh")), T0) == []
    assert runs.rejected == {"bad_metadata_json": 1}
    assert "fresh" not in runs and len(runs) == 0
    assert runs.snapshot() == []


def test_sink_rejects_are_counted_and_the_run_survives() -> None:
    runs = Runs()
    runs.ingest(enc(register(world_size=2)), T0)
    seq = runs.get("r1").seq
    assert runs.ingest(enc(register(world_size=3, rank=1)), T0) == []
    assert runs.ingest(enc(metrics(rank=5)), T0) == []
    assert runs.rejected == {"world_size_mismatch": 1, "rank_out_of_range": 1}
    assert runs.get("r1").seq == seq  # no effect at all


def test_rejections_log_one_line_per_interval_without_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    rlog = RateLimitedLog(logging.getLogger("broker.runs"), 10.0, clock=lambda: now[0])
    runs = Runs(rate_log=rlog)
    with caplog.at_level(logging.WARNING, logger="broker.runs"):
        for _ in range(100):
            runs.ingest(b"\xc1", T0)
    assert runs.rejected == {"decode": 100}
    lines = [r for r in caplog.records if r.name == "broker.runs"]
    assert len(lines) == 1
    assert not lines[0].exc_info and "decode" in lines[0].getMessage()
    now[0] = 11.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="broker.runs"):
        runs.ingest(b"\xc1", T0)
    assert "99 similar suppressed" in caplog.records[0].getMessage()


# -- hooks, late metrics, tick, snapshot ---------------------------------------------------


def test_on_accept_sees_only_accepted_frames_with_their_bytes() -> None:
    seen = []
    runs = Runs(on_accept=lambda run, raw, frame, now: seen.append((run, raw, type(frame), now)))
    good = enc(register())
    runs.ingest(good, T0)
    runs.ingest(b"\xc1", T0)
    runs.ingest(enc(bad_metadata()), T0)
    assert seen == [("r1", good, protocol.Register, T0)]


def test_late_metrics_total() -> None:
    runs = Runs()
    runs.ingest(enc(register()), T0)
    runs.ingest(enc(metrics(epoch=0)), T0)
    runs.ingest(enc(metrics(epoch=0, avg_loss=2.0)), T0 + 1)  # epoch 0 already closed
    assert runs.late_metrics == 1
    assert runs.counters() == {"accepted": 3, "rejected": {}, "late_metrics": 1, "runs": 1,
                                "late_steps": 0, "steps_closed": 0, "evictions": 0}


def test_tick_returns_run_tagged_events() -> None:
    runs = Runs(stale_after=5.0)
    runs.ingest(enc(register(run="a")), T0)
    runs.ingest(enc(register(run="b")), T0)
    out = runs.tick(T0 + 10.0)  # both ranks went stale; ranks arrays due
    assert {run for run, _ in out} == {"a", "b"}
    assert "ranks" in kinds(out)
    assert runs.get("a").ranks()[0]["status"] == "stale"


def test_snapshot_all_one_and_unknown() -> None:
    runs = Runs()
    runs.ingest(enc(register(run="a")), T0)
    runs.ingest(enc(register(run="b")), T0)
    assert sorted(s["run"] for s in runs.snapshot()) == ["a", "b"]
    [one] = runs.snapshot("a")
    assert one["run"] == "a" and one["seq"] == runs.get("a").seq
    assert runs.snapshot("nope") == []


# -- the run cap ---------------------------------------------------------------------------


def _finished_run(runs: Runs, run: str, now: float) -> None:
    runs.ingest(enc(register(run=run)), now)
    runs.ingest(enc(metrics(run=run)), now)
    runs.ingest(enc(finish(run=run)), now)
    assert runs.get(run).complete is not None


def test_full_registry_evicts_the_least_recently_active_run() -> None:
    evicted = []
    runs = Runs(max_runs=3, on_evict=evicted.append)
    _finished_run(runs, "old", T0)
    _finished_run(runs, "newer", T0 + 1)
    runs.ingest(enc(register(run="live")), T0 + 2)
    late_before = runs.late_metrics
    last = runs.get("old").seq
    out = runs.ingest(enc(register(run="fourth")), T0 + 3)
    assert "old" not in runs and {"newer", "live", "fourth"} == set(runs)
    assert evicted == ["old"]
    # the eviction is an event, first, for the server to publish: webs drop the run
    assert out[0] == ("old", Event(last + 1, "evicted", {"run": "old"}))
    assert [run for run, _ in out[1:]] == ["fourth"] * (len(out) - 1)
    assert runs.late_metrics == late_before and runs.evictions == 1
    assert not runs.rejected


def test_activity_order_decides_which_run_is_evicted() -> None:
    runs = Runs(max_runs=2)
    _finished_run(runs, "a", T0)
    _finished_run(runs, "b", T0 + 1)
    runs.ingest(enc(metrics(run="a", epoch=7)), T0 + 2)  # a is active again (late or not)
    runs.ingest(enc(register(run="c")), T0 + 3)
    assert set(runs) == {"a", "c"}


def test_never_finished_runs_do_not_lock_out_new_ones() -> None:
    """Issue 19 finding 6 (contract v3 section 6): the least recently active run goes,
    whatever its status; max_runs junk runs that never finish used to refuse every new run
    (``too_many_runs``), across restarts."""
    runs = Runs(max_runs=2)
    runs.ingest(enc(register(run="a")), T0)
    runs.ingest(enc(register(run="b")), T0 + 1)
    runs.ingest(enc(metrics(run="a")), T0 + 2)  # a is now more recently active than b
    out = runs.ingest(enc(register(run="c")), T0 + 3)
    assert out and out[0][0] == "b" and out[0][1].kind == "evicted"
    assert runs.rejected == {} and set(runs) == {"a", "c"}
    for i in range(100):  # a flood of new ids keeps taking the oldest place
        runs.ingest(enc(register(run=f"junk{i}")), T0 + 10 + i)
    assert runs.rejected == {} and set(runs) == {"junk98", "junk99"}
    assert runs.evictions == 101
    # an evicted run that speaks again comes back, its ids still increasing
    out = runs.ingest(enc(metrics(run="a", epoch=1)), T0 + 200)
    assert "a" in runs and out[0] == ("junk98", Event(out[0][1].seq, "evicted",
                                                      {"run": "junk98"}))


def test_rejected_frame_of_a_new_run_evicts_nothing() -> None:
    runs = Runs(max_runs=1)
    _finished_run(runs, "a", T0)
    runs.ingest(enc(bad_metadata(run="b")), T0)
    assert set(runs) == {"a"}
    assert runs.rejected == {"bad_metadata_json": 1}


def test_evicted_run_coming_back_keeps_ids_increasing_with_a_gap() -> None:
    runs = Runs(max_runs=1)
    _finished_run(runs, "a", T0)
    last = runs.get("a").seq
    runs.ingest(enc(register(run="b")), T0)
    assert "a" not in runs
    runs.ingest(enc(finish(run="b")), T0)
    out = runs.ingest(enc(register(run="a")), T0 + 5)
    # the eviction took last + 1; one more id skipped on purpose: the web sees the gap
    # and re-snapshots the run
    assert out[0][0] == "b" and out[0][1].kind == "evicted"  # b makes room for a
    assert [ev for run, ev in out if run == "a"][0].seq == last + 3


def test_loader_brings_back_an_evicted_run() -> None:
    stash = {}
    runs = Runs(max_runs=1, loader=lambda run: stash.pop(run, None),
                on_evict=lambda run: None)
    _finished_run(runs, "a", T0)
    stash["a"] = runs.get("a")
    runs.ingest(enc(register(run="b")), T0)
    runs.ingest(enc(finish(run="b")), T0)
    assert "a" not in runs
    runs.ingest(enc(register(run="a")), T0)
    assert "a" in runs and len(runs.get("a").records) == 1


def test_max_runs_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Runs(max_runs=0)


# -- RateLimitedLog ------------------------------------------------------------------------


def test_rate_limited_log_per_key(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    rl = RateLimitedLog(logging.getLogger("t.rl"), 5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t.rl"):
        assert rl.warning("a", "first %s", 1)
        assert not rl.warning("a", "again")
        assert not rl.warning("a", "again")
        assert rl.warning("b", "other key")
        assert rl.suppressed("a") == 2
        now[0] += 5.0
        assert rl.warning("a", "after %d", 2)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["first 1", "other key", "after 2 (2 similar suppressed)"]
    assert rl.suppressed("a") == 0


def test_rate_limited_log_bounds_its_keys() -> None:
    rl = RateLimitedLog(logging.getLogger("t.rl2"), 5.0, clock=lambda: 0.0, max_keys=3)
    for i in range(10):
        rl.warning(i, "x")
    assert len(rl._keys) == 3


# -- one run-id definition -------------------------------------------------------------------

#: Files (not this helper's) that still spell the run-id character class themselves; each
#: should import rank_agent.protocol.RUN_ID_CHARS / RUN_ID_RE / valid_run_id instead, and
#: leave this set when it does.
_RUN_ID_COPIES_PENDING = {"broker/journal/journal.py", "rank_agent/agent.py", "web/app.py"}


def test_the_run_id_pattern_is_defined_once() -> None:
    """The wire's RunId, and every Python module that checks a run id, use one pattern."""
    import pathlib

    from rank_agent import protocol

    assert protocol.RunId.__metadata__[0].pattern == protocol.RUN_ID_PATTERN
    assert protocol.RUN_ID_CHARS in protocol.RUN_ID_PATTERN
    root = pathlib.Path(__file__).resolve().parents[2]
    spelled = set()
    for path in [*root.glob("broker/*.py"), *root.glob("rank_agent/**/*.py"),
                 *root.glob("web/*.py")]:
        rel = path.relative_to(root).as_posix()
        if rel != "rank_agent/protocol.py" and "A-Za-z0-9._:" in path.read_text():
            spelled.add(rel)
    assert spelled <= _RUN_ID_COPIES_PENDING, spelled - _RUN_ID_COPIES_PENDING

"""PROTOCOL 8.4's pure parts: ``--retain-bytes`` sizes, the scan of ``runs/`` and the plan of
which ended runs go (no sockets, no broker)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.retention.plan import DiskRun, MemRun, interval_from_env, parse_size, plan, scan_runs

DAY = 86400.0


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("4096", 4096), ("1k", 1024), ("1K", 1024), ("3m", 3 * 1024 ** 2),
    ("2G", 2 * 1024 ** 3), ("1t", 1024 ** 4), ("500G", 500 * 1024 ** 3),
])
def test_parse_size_takes_bytes_and_binary_suffixes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["0", "0K", "-1", "1.5G", "1KB", "1P", "G", "", "ten", "1 0", "1 K", " 1", "１"])
def test_parse_size_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_interval_env_is_bounded_by_the_default() -> None:
    assert interval_from_env({}) == 30.0
    assert interval_from_env({"RANKBOARD_RETENTION_INTERVAL": "0.2"}) == 0.2
    assert interval_from_env({"RANKBOARD_RETENTION_INTERVAL": "600"}) == 30.0
    assert interval_from_env({"RANKBOARD_RETENTION_INTERVAL": "x"}) == 30.0


def _disk(run: str, nbytes: int, mtime: float) -> DiskRun:
    return DiskRun(run, nbytes, mtime, (f"/d/{run}.journal",))


def test_bytes_rule_deletes_ended_runs_least_recently_updated_first() -> None:
    now = 10_000.0
    disk = {r.run: r for r in (_disk("a", 100, now - 500), _disk("b", 100, now - 400),
                               _disk("c", 100, now - 300), _disk("live", 100, now))}
    out = plan(disk, {"live": MemRun(now, False)}, retain_bytes=250, retention_days=None,
               stale_after=30.0, now=now)
    assert [(v[0], v[1]) for v in out.victims] == [("a", "bytes"), ("b", "bytes")]
    assert out.total == 400 and out.live_over == 0


def test_a_live_run_is_never_deleted_and_the_excess_is_reported() -> None:
    now = 10_000.0
    disk = {"old": _disk("old", 100, now - 500), "live": _disk("live", 1000, now - 500)}
    # held, not ended by its state, and as new as the newest frame: live
    out = plan(disk, {"live": MemRun(now, False)}, retain_bytes=500, retention_days=None,
               stale_after=30.0, now=now)
    assert [v[0] for v in out.victims] == ["old"]
    assert out.live_over == 500


def test_a_held_run_ended_by_its_state_goes_even_when_recent() -> None:
    now = 10_000.0
    disk = {"done": _disk("done", 100, now), "live": _disk("live", 100, now)}
    mem = {"done": MemRun(now - 1, True), "live": MemRun(now, False)}
    out = plan(disk, mem, retain_bytes=150, retention_days=None, stale_after=30.0, now=now)
    assert [v[0] for v in out.victims] == ["done"]
    assert out.victims[0][2] == now - 1  # judged at this updated_at


def test_the_stale_rule_counts_from_the_newest_frame_not_the_clock() -> None:
    """A broker stopped for a week (a long upgrade): nothing its data dir holds is more than
    --stale-after older than the newest frame there, so nothing is deletable."""
    now = 10 * DAY
    disk = {"x": _disk("x", 100, now - 7 * DAY - 5), "y": _disk("y", 100, now - 7 * DAY)}
    out = plan(disk, {}, retain_bytes=1, retention_days=None, stale_after=30.0, now=now)
    assert out.victims == [] and out.live_over == 199


def test_a_held_runs_file_mtime_is_not_its_age() -> None:
    """At start the load writes every held run's file: its mtime is now, its frames are not."""
    now = 10 * DAY
    disk = {"x": _disk("x", 100, now), "y": _disk("y", 100, now)}
    mem = {"x": MemRun(now - 7 * DAY - 60, False), "y": MemRun(now - 7 * DAY, False)}
    out = plan(disk, mem, retain_bytes=150, retention_days=None, stale_after=30.0, now=now)
    assert [v[0] for v in out.victims] == ["x"]


def test_days_rule_and_bytes_rule_each_name_their_reason_once() -> None:
    now = 10 * DAY
    disk = {"ancient": _disk("ancient", 100, now - 5 * DAY),
            "old": _disk("old", 100, now - 2 * DAY),
            "recent": _disk("recent", 100, now - 600), "live": _disk("live", 100, now)}
    out = plan(disk, {"live": MemRun(now, False)}, retain_bytes=150, retention_days=3.0,
               stale_after=30.0, now=now)
    assert [(v[0], v[1]) for v in out.victims] == [
        ("ancient", "days"), ("old", "bytes"), ("recent", "bytes")]
    out = plan(disk, {"live": MemRun(now, False)}, retain_bytes=None, retention_days=0.5,
               stale_after=30.0, now=now)
    assert [(v[0], v[1]) for v in out.victims] == [("ancient", "days"), ("old", "days")]


def test_scan_groups_a_journal_with_the_files_set_aside_beside_it(tmp_path: Path) -> None:
    (tmp_path / "r1.journal").write_bytes(b"x" * 5000)
    (tmp_path / "r1.journal.damaged-17").write_bytes(b"y" * 5000)
    (tmp_path / "r2.journal.unreadable-3").write_bytes(b"z" * 10)
    (tmp_path / "r2.journal.damaged-4").write_bytes(b"z" * 10)
    os.utime(tmp_path / "r2.journal.unreadable-3", (500.0, 500.0))
    os.utime(tmp_path / "r2.journal.damaged-4", (700.0, 700.0))
    os.utime(tmp_path / "r1.journal.damaged-17", (5000.0, 5000.0))
    (tmp_path / "notes.txt").write_bytes(b"ignored")
    (tmp_path / ".probe-x").write_bytes(b"ignored")
    os.utime(tmp_path / "r1.journal", (1000.0, 1000.0))
    got = scan_runs(str(tmp_path))
    assert sorted(got) == ["r1", "r2"]
    assert len(got["r1"].paths) == 2 and got["r1"].mtime == 1000.0  # the journal's
    assert len(got["r2"].paths) == 2 and got["r2"].mtime == 700.0  # no journal: the newest
    assert got["r1"].bytes >= 10_000  # bytes on disk: blocks, at least the sizes
    assert scan_runs(str(tmp_path / "missing")) == {}

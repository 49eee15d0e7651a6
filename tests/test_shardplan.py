"""``up --shards N``'s plan (rankboard/shardplan.py): ports + 3 × K, ``shard-K`` data dirs,
the ``RANKBOARD_BROKER`` line with a wildcard address named by the host."""
from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import BrokerConfig
from rankboard.shardplan import broker_line, shard_configs, shift_port


def test_one_shard_is_the_config_unchanged() -> None:
    cfg = BrokerConfig(data_dir=Path("/d"))
    assert shard_configs(cfg, 1) == [cfg]


def test_n_shards_shift_ports_and_dirs() -> None:
    cfg = BrokerConfig(ingest="tcp://*:5585", publish="tcp://127.0.0.1:5586",
                       snapshot="tcp://127.0.0.1:*", data_dir=Path("/d"))
    plan = shard_configs(cfg, 3)
    assert [c.ingest for c in plan] == ["tcp://*:5585", "tcp://*:5588", "tcp://*:5591"]
    assert [c.publish for c in plan] == [
        "tcp://127.0.0.1:5586", "tcp://127.0.0.1:5589", "tcp://127.0.0.1:5592"]
    assert {c.snapshot for c in plan} == {"tcp://127.0.0.1:*"}
    assert [c.data_dir for c in plan] == [Path("/d/shard-0"), Path("/d/shard-1"),
                                          Path("/d/shard-2")]
    assert [c.shard for c in plan] == [(0, 3), (1, 3), (2, 3)]
    assert plan[2].argv()[plan[2].argv().index("--shard") + 1] == "2/3"


def test_bad_endpoints() -> None:
    with pytest.raises(ValueError, match="TCP endpoints"):
        shift_port("ipc:///tmp/x", 3)
    with pytest.raises(ValueError, match="65535"):
        shift_port("tcp://h:65534", 3)


def test_broker_line_names_wildcards_by_host() -> None:
    line = broker_line(["tcp://0.0.0.0:5585", "tcp://*:5588", "tcp://10.0.0.2:5591"],
                       hostname=lambda: "head")
    assert line == "RANKBOARD_BROKER=tcp://head:5585,tcp://head:5588,tcp://10.0.0.2:5591"


def test_unsharded_runs_are_named_only_when_sharding_hides_them(tmp_path: Path) -> None:
    from rankboard.shardplan import unsharded_runs_note

    assert unsharded_runs_note(tmp_path, 2) is None  # no runs dir
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.journal").write_bytes(b"x")
    (tmp_path / "runs" / "a.journal.damaged-1").write_bytes(b"x")
    assert unsharded_runs_note(tmp_path, 1) is None  # one broker serves them
    note = unsharded_runs_note(tmp_path, 3)
    assert note is not None and "holds 1 run(s)" in note and "--shards 3" in note


def test_n_shards_split_retain_bytes_evenly() -> None:
    """PROTOCOL 8.4: each shard's broker bounds its own data dir by SIZE ÷ N."""
    cfg = BrokerConfig(data_dir=Path("/d"), retain_bytes=3 * 1024 ** 3 + 2)
    plan = shard_configs(cfg, 3)
    assert [c.retain_bytes for c in plan] == [1024 ** 3] * 3
    argv = plan[1].argv()
    assert argv[argv.index("--retain-bytes") + 1] == str(1024 ** 3)
    assert [c.retain_bytes for c in shard_configs(BrokerConfig(data_dir=Path("/d")), 2)] == [
        None, None]
    assert shard_configs(cfg, 1)[0].retain_bytes == 3 * 1024 ** 3 + 2

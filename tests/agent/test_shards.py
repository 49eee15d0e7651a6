"""The shard of a run id (PROTOCOL 7.3): the jump hash, its key, the lists and ``K/N``."""
from __future__ import annotations

import ctypes
import hashlib
import struct
from collections import Counter

import pytest

from rank_agent.shards import (
    MAX_SHARD_COUNT,
    ShardError,
    jump,
    parse_shard,
    pick_control,
    pick_endpoint,
    run_key,
    shard_of,
    split_endpoints,
)


def _reference_jump(key: int, buckets: int) -> int:
    """The paper's C, written out independently: uint64 wrap-around by ctypes, the
    division in doubles packed and unpacked through ``struct`` (IEEE binary64)."""
    k = ctypes.c_uint64(key)
    b, j = -1, 0
    while j < buckets:
        b = j
        k = ctypes.c_uint64(k.value * 2862933555777941757 + 1)
        ratio = struct.unpack("<d", struct.pack("<d", float(1 << 31)))[0] / \
            struct.unpack("<d", struct.pack("<d", float((k.value >> 33) + 1)))[0]
        j = int(float(b + 1) * ratio)
    return b


def _reference_key(run: str) -> int:
    return struct.unpack(">Q", hashlib.sha256(run.encode()).digest()[:8])[0]


def test_published_vectors() -> None:
    # the rows a widely used port of the paper's C (go-jump) checks, buckets 1..19
    assert [jump(1, n) for n in range(1, 20)] == [
        0, 0, 0, 0, 0, 0, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 17, 17]
    assert [jump(0xDEADBEEF, n) for n in range(1, 20)] == [
        0, 1, 2, 3, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 16, 16, 16]


def test_fixed_run_ids() -> None:
    # fixed vectors: what every agent, broker and web of any version must compute alike
    assert run_key("run-a") == 0x66B1EB530FB748A4
    assert [shard_of("run-a", n) for n in (1, 2, 3, 4, 8, 100)] == [0, 0, 2, 2, 2, 32]
    assert [shard_of("job-42", n) for n in (1, 2, 3, 4, 8, 100)] == [0, 1, 1, 3, 4, 51]
    assert [shard_of("12345.0", n) for n in (1, 2, 3, 4, 8, 100)] == [0, 0, 2, 2, 2, 55]


@pytest.mark.parametrize("run", ["run-a", "x", "12345.0", "job:7", "é-unicode", "a" * 128])
def test_agrees_with_an_independent_implementation(run: str) -> None:
    assert run_key(run) == _reference_key(run)
    for n in (1, 2, 3, 5, 7, 16, 1000, 65536):
        assert shard_of(run, n) == _reference_jump(_reference_key(run), n)


def test_extreme_keys() -> None:
    for key in (0, 1, (1 << 63), (1 << 64) - 1):
        for n in (1, 2, 10, 1 << 20):
            assert jump(key, n) == _reference_jump(key, n)
            assert 0 <= jump(key, n) < n


def test_uniform_over_shards() -> None:
    runs = [f"run-{i}" for i in range(20_000)]
    for n in (2, 3, 5):
        counts = Counter(shard_of(r, n) for r in runs)
        assert sorted(counts) == list(range(n))
        for c in counts.values():  # within 5 % of an even share
            assert abs(c - len(runs) / n) < 0.05 * len(runs) / n


def test_changing_n_moves_about_one_in_n() -> None:
    runs = [f"job-{i}" for i in range(20_000)]
    for n in (1, 2, 4, 9):
        moved = [r for r in runs if shard_of(r, n) != shard_of(r, n + 1)]
        share = len(moved) / len(runs)
        assert abs(share - 1 / (n + 1)) < 0.02
        assert all(shard_of(r, n + 1) == n for r in moved)  # only ever to the new shard


def test_bad_buckets() -> None:
    with pytest.raises(ValueError):
        jump(1, 0)


def test_parse_shard() -> None:
    assert parse_shard("0/1") == (0, 1)
    assert parse_shard(" 2/3 ") == (2, 3)
    for bad in ("", "1", "3/3", "-1/2", "0/0", "a/b", "1/2/3", "0/-1"):
        with pytest.raises(ShardError):
            parse_shard(bad)


def test_parse_shard_bounds_n_and_reads_only_ascii_digits() -> None:
    """Issue 38: ``--shard 0/<400 digits>`` was accepted and then every new run's frame
    failed (the jump hash's doubles overflow). N is at most MAX_SHARD_COUNT (1,024); K and
    N are ASCII digits."""
    assert MAX_SHARD_COUNT == 1024
    assert parse_shard("1023/1024") == (1023, 1024)
    for bad, says in (("0/" + "9" * 400, "N must be 1..1024"), ("0/1025", "N must be 1..1024"),
                      ("0/\u0663", "expected K/N"), ("\u0663/4", "expected K/N"),
                      ("0/1_0", "expected K/N"), ("+0/2", "expected K/N"),
                      ("9" * 400 + "/2", "K must be 0..1")):
        with pytest.raises(ShardError, match=says) as caught:
            parse_shard(bad)
        assert len(str(caught.value)) < 120  # one readable line, not the 400 digits


def test_lists() -> None:
    assert split_endpoints(" tcp://a:1 , tcp://b:1") == ["tcp://a:1", "tcp://b:1"]
    for bad in ("", "tcp://a:1,", "tcp://a:1,,tcp://b:1"):
        with pytest.raises(ShardError):
            split_endpoints(bad)
    assert pick_endpoint("tcp://a:1", "run-a") == ("tcp://a:1", 0, 1)
    brokers = "tcp://a:1,tcp://b:1,tcp://c:1"
    assert pick_endpoint(brokers, "run-a") == ("tcp://c:1", 2, 3)
    assert pick_endpoint(brokers, "job-42") == ("tcp://b:1", 1, 3)
    assert pick_control("tcp://a:2,tcp://b:2,tcp://c:2", 2, 3) == "tcp://c:2"
    assert pick_control("tcp://a:2,tcp://b:2", 1, 3) is None
    assert pick_control("tcp://a:2", 0, 1) == "tcp://a:2"

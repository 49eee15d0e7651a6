"""Issue 38, item 5: ``/api/hosts`` is built off the web's event loop and cached per state;
``rankboard_host_suspect`` is capped like the per-rank series, with a per-run count always
(``web/hostsanswer.py``). The rules themselves are ``web/cluster.py``'s (tests/web/test_cluster.py)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any, Callable

import msgspec
import pytest
from prometheus_client import generate_latest

from tests.support import REPO
from tests.support.http import fetch
from tests.web.test_cluster import put
from web import hostsanswer
from web.hostsanswer import HostsAnswer
from web.hub import Hub
from web.metrics import make_registry


def held_hub() -> Hub:
    hub = Hub()
    put(hub, "a", started=2.0, hosts={"n1": [0], "n2": [1]}, alerts=[("gpu_xid", 0, 5.0)])
    put(hub, "b", started=1.0, hosts={"n2": [0], "n3": [1]}, alerts=[("stalled", 0, 4.0)])
    return hub


def test_the_answer_is_the_rules_built_off_the_loop_once_per_state() -> None:
    hub = held_hub()
    answers = HostsAnswer()
    calls: list[str] = []

    def offload(fn: Callable[[], Any]) -> Any:
        calls.append("off")
        cache = dict(hub.cluster._hosts)
        out = fn()
        assert hub.cluster._hosts == cache  # the thread never writes what the loop reads
        return out

    encode = msgspec.json.encode
    first = answers.get(hub, hub.cluster, encode, offload)
    assert msgspec.json.decode(first) == hub.cluster.hosts(hub)
    assert answers.get(hub, hub.cluster, encode, offload) is first and calls == ["off"]
    assert set(hub.cluster._hosts) == {"a", "b"}  # what the worker derived was kept
    put(hub, "b", started=1.0, hosts={"n2": [0], "n3": [1]}, alerts=[("stalled", 1, 6.0)])
    second = answers.get(hub, hub.cluster, encode, offload)
    assert calls == ["off", "off"] and second != first
    assert msgspec.json.decode(second) == hub.cluster.hosts(hub)
    del hub.runs["a"]
    third = msgspec.json.decode(answers.get(hub, hub.cluster, encode, offload))
    assert sorted(h["host"] for h in third) == ["n2", "n3"] and third == hub.cluster.hosts(hub)


def test_the_suspect_series_are_capped_with_a_count_per_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hub = Hub()
    put(hub, "a", started=2.0, hosts={f"n{i}": [i] for i in range(10)},
        alerts=[("gpu_xid", 3, 5.0), ("gpu_ecc", 7, 5.0)])
    put(hub, "b", started=1.0, hosts={"m0": [0], "n3": [1]}, alerts=[])
    text = generate_latest(make_registry(hub)).decode()
    assert text.count("rankboard_host_suspect{") == 11
    monkeypatch.setattr(hostsanswer, "MAX_HOST_SERIES", 4)
    text = generate_latest(make_registry(hub)).decode()
    assert sorted(line for line in text.splitlines()
                  if line.startswith("rankboard_host_suspect{")) == [
        'rankboard_host_suspect{host="n3"} 1.0', 'rankboard_host_suspect{host="n7"} 1.0']
    assert "rankboard_host_suspect_omitted 9.0" in text
    assert 'rankboard_run_suspect_hosts{run="a"} 2.0' in text
    assert 'rankboard_run_suspect_hosts{run="b"} 1.0' in text  # n3 is b's too


def test_healthz_answers_while_the_hosts_of_96000_hosts_are_built() -> None:
    """On the loop, this answer held /healthz for seconds (3.45 s at 96,000 hosts)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hostsweb", "96000"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("port "), line
        port = int(line.split()[1])
        out: dict[str, Any] = {}

        def ask() -> None:
            t0 = time.perf_counter()
            resp = fetch(port, "/api/hosts", timeout=120)
            out["s"], out["status"], out["body"] = time.perf_counter() - t0, resp.status, resp.body

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        latencies = []
        while thread.is_alive():
            t0 = time.perf_counter()
            assert fetch(port, "/healthz", timeout=120).status in (200, 503)
            latencies.append(time.perf_counter() - t0)
        thread.join(120)
        assert out["status"] == 200
        hosts = msgspec.json.decode(out["body"])
        assert len(hosts) == 96000 and hosts[0]["suspect"]
        assert latencies and max(latencies) < 0.5, (max(latencies), len(latencies), out["s"])
        t0 = time.perf_counter()
        assert fetch(port, "/api/hosts", timeout=120).body == out["body"]  # cached
        assert time.perf_counter() - t0 < out["s"]
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

"""retention_scan_10000_runs_s and journal_full_e2e_p99_ms: PROTOCOL 8.4's two figures.

* **retention_scan_10000_runs_s**: one retention pass (``broker.retention.plan``: list ``runs/``,
  stat every file, plan the deletions) over a data dir of 10,000 journals (8 KiB each, every
  fifth with a file set aside beside it), with 1,000 of the runs held in memory and
  ``--retain-bytes`` at half the total, so the plan names thousands of runs. This is what
  the broker's retention thread does each pass, never on the receive loop; the loop only
  deletes the planned runs, :data:`broker.retention.loop.DELETES_PER_TURN` per turn (their
  cost: ``delete_us_per_run``). Page cache warm (the files were just written), as a pass
  every 30 s finds them. Median of 3 passes.
* **journal_full_e2e_p99_ms**: web_bench's ``e2e_latency_p99_ms`` (64 ranks, the last
  rank's metrics sent → the ``epoch`` event read from the SSE stream) with the broker's data
  dir on a 4 MiB tmpfs filled to the last byte before the run starts, so every journal
  write fails (counted: ``write_failures``); the broker keeps serving from memory. Needs
  root (``mount``), as the tests do. Baseline: the same e2e on a data dir that takes every
  write, measured right after in the same run.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, Stack, http_get, result

sys.path.insert(0, str(REPO))

from broker.journal.codec import HEADER  # noqa: E402
from broker.retention.plan import MemRun, RetentionWorker  # noqa: E402


def _write_dir(runs_dir: Path, n: int) -> None:
    runs_dir.mkdir(parents=True)
    body = HEADER + os.urandom(8192 - len(HEADER))
    base = time.time() - n
    for i in range(n):
        path = runs_dir / f"run-{i:05d}.journal"
        path.write_bytes(body)
        os.utime(path, (base + i, base + i))
        if i % 5 == 0:
            (runs_dir / f"run-{i:05d}.journal.damaged-1700000000").write_bytes(body[:1000])


def scan(n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rankboard-retention-") as tmp:
        runs_dir = Path(tmp) / "runs"
        _write_dir(runs_dir, n)
        now = time.time()
        held = {f"run-{i:05d}": MemRun(now - (n - i), False) for i in range(n - 1000, n)}
        total = sum(os.stat(p).st_blocks * 512 for p in runs_dir.iterdir())
        worker = RetentionWorker(str(runs_dir), retain_bytes=total // 2, retention_days=None,
                                 stale_after=30.0)
        times = []
        plan = None
        for _ in range(3):
            plan = worker.run_now(held)
            times.append(worker.last_pass_s)
        assert plan is not None
        # what the loop does per planned run: unlink its files (here: 200 of them)
        t0 = time.perf_counter()
        done = 0
        for _, _, _, paths, _ in plan.victims[:200]:
            for p in paths:
                os.unlink(p)
            done += 1
        per_run_us = (time.perf_counter() - t0) / max(1, done) * 1e6
    return result("retention_scan_10000_runs_s", round(statistics.median(times), 3), "s",
                  runs=n, files=n + n // 5, held=1000, planned=len(plan.victims),
                  max_s=round(max(times), 3), delete_us_per_run=round(per_run_us, 1))


def _fill(path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 512, 1):
            chunk = b"\0" * size
            while True:
                try:
                    f.write(chunk)
                except OSError:
                    break


def journal_full(epochs: int) -> list[dict[str, Any]]:
    import web_bench

    with tempfile.TemporaryDirectory(prefix="rankboard-full-") as tmp:
        disk = Path(tmp) / "disk"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                       check=True)
        try:
            stack = Stack(disk / "data")
            try:
                _fill(disk / "filler")
                got = web_bench.e2e(stack, epochs)
                status, body = http_get(stack.port, "/healthz")
                journal = json.loads(body).get("journal")
                failures = sum(1 for line in stack.broker.tail(100000).splitlines()
                               if "cannot write" in line)
            finally:
                stack.close()
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    p99 = next(r for r in got if r["name"] == "e2e_latency_p99_ms")
    p50 = next(r for r in got if r["name"] == "e2e_latency_p50_ms")
    assert journal == "failing" and status == 200, (status, journal)
    return [result("journal_full_e2e_p99_ms", p99["value"], "ms", p50_ms=p50["value"],
                   epochs=p99["_extra"]["epochs"], ranks=64, healthz_journal=journal,
                   write_failure_log_lines=failures)]


def _normal_disk_p99(epochs: int) -> float:
    """The same e2e on a data dir that takes every write: the baseline, measured in the
    same run (the machine is shared; an absolute figure alone says little)."""
    import web_bench

    with tempfile.TemporaryDirectory(prefix="rankboard-ok-") as tmp:
        stack = Stack(Path(tmp) / "data")
        try:
            got = web_bench.e2e(stack, epochs)
        finally:
            stack.close()
    return float(next(r for r in got if r["name"] == "e2e_latency_p99_ms")["value"])


def run(quick: bool) -> list[dict[str, Any]]:
    epochs = 40 if quick else 300
    full = journal_full(epochs)
    base = _normal_disk_p99(epochs)
    full[0]["baseline"] = base
    full[0]["ratio"] = round(full[0]["value"] / base, 3) if base else None
    return [scan(2000 if quick else 10_000), *full]


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))

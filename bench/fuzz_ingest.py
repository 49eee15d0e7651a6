"""Fuzz the broker's ingest: N seeded hostile and valid frames through the REAL PULL socket
of a real ``rankboard broker`` process; prints frames fuzzed, crashes, valid frames lost
(epoch records of the check run, and closed steps of the check steps run, each compared with
a brute-force PROTOCOL 2.3/2.4 reference), steps closed and late step points, and
rejections by reason (tests/support/fuzzgen.py has the generator, fuzzrun.py the checks).
``steps`` frames are part of the traffic: valid ones (NaN/inf, huge steps and integers,
1024 points, 64 names) and hostile ones (unequal lengths, non-increasing steps, empty,
1025 points, 65 names, long names, None times, wrong types, integers past their bounds).

    python bench/fuzz_ingest.py --frames 100000 --seed 1

Then a second broker starts on the same data dir (issue 38: replaying what the first
journaled must neither fail nor set anything aside); it prints how many runs it restored.

Exit status 0 when the broker survived, no valid frame (epoch or steps) was lost, every
check step closed exactly once with the expected figures, every counter is within what
the generator expects, and the restart restored the runs without an error; 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import fuzzgen, fuzzrun  # noqa: E402

BOUND = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")


def start_broker(data_dir: str, max_runs: int) -> tuple[subprocess.Popen[str], dict[str, str]]:
    any_port = "tcp://127.0.0.1:*"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankboard", "broker", "--ingest", any_port, "--publish",
         any_port, "--snapshot", any_port, "--data-dir", data_dir, "--max-runs", str(max_runs),
         "--log-level", "INFO"],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: dict[str, str] = {}
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while len(found) < 3 and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = BOUND.search(line)
        if m:
            found[m.group(1)] = m.group(2)
    if len(found) < 3:
        proc.kill()
        raise SystemExit("the broker did not start")
    return proc, found


RESTORED = re.compile(r"journal .*: (\d+) runs restored")


def restart(data_dir: str, max_runs: int) -> tuple[int | None, float, list[str]]:
    """A broker started again on ``data_dir``: (runs it restored, seconds to start, its
    ERROR/Traceback/set-aside lines), then stopped."""
    t0 = time.monotonic()
    proc, _ = start_broker(data_dir, max_runs)
    restored: int | None = None
    lines: list[str] = []
    assert proc.stderr is not None
    while restored is None:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = RESTORED.search(line)
        if m:
            restored = int(m.group(1))
    took = time.monotonic() - t0
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    lines += (err or "").splitlines()
    bad = [line.rstrip() for line in lines if "Traceback" in line or " ERROR " in line
           or "could not be replayed" in line or "damaged" in line]
    return restored, took, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-big", action="store_true", help="skip the MiB-sized frames")
    args = parser.parse_args()
    t0 = time.monotonic()
    msgs, epochs = fuzzgen.generate(args.frames, args.seed, big=not args.no_big)
    print(f"generated {len(msgs)} frames in {time.monotonic() - t0:.1f} s (seed {args.seed})",
          flush=True)
    new_runs = sum(1 for m in msgs if m.kind == "new_run")
    with tempfile.TemporaryDirectory(prefix="rankboard-fuzz-") as data_dir:
        proc, eps = start_broker(data_dir, max_runs=2 * new_runs + 100)
        errors: list[str] = []
        try:
            report = fuzzrun.run_fuzz(eps["ingest"], eps["publish"], eps["snapshot"], msgs,
                                      epochs, alive=lambda: proc.poll() is None, timeout=600)
        finally:
            if proc.poll() is None:
                proc.terminate()
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            errors = [line for line in (err or "").splitlines()
                      if "Traceback" in line or " ERROR " in line]
        restored, took, restart_errors = restart(data_dir, 2 * new_runs + 100)
    for line in report.lines():
        print(line)
    print(f"broker exit status: {proc.returncode}; ERROR/Traceback lines in its log: "
          f"{len(errors)}")
    for line in errors[:10]:
        print("  " + line)
    print(f"restart on its data dir: {restored} runs restored in {took:.1f} s; "
          f"ERROR/Traceback/set-aside lines: {len(restart_errors)}")
    for line in restart_errors[:10]:
        print("  " + line)
    ok = (report.broker_alive and not report.problems and report.valid_lost == 0
          and report.check_steps_closed == report.check_steps and not errors
          and restored is not None and restored > 0 and not restart_errors)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

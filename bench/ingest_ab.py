"""ingest_cpu_ab_<base>: the broker's CPU per frame on a sampler flood, this tree ÷ another
tree (default 1613263, main before the v3 issues), alternated in one run (issue 33).

The workload is the one a user's cluster puts on ``rankboard up``, through the public
surface only: ``rankboard up`` started as a subprocess (its broker child and its web), one
run of 64 ranks registered (world size 64, one epoch), then 2 sender processes
(``--senders``: connections; in a cluster each rank's agent is one, and each connection's
receive queue holds ``INGEST_RCVHWM`` messages) each push ``--frames`` ``resources`` frames
over their share of the ranks (a ``ResourceSample`` with
cpu/ram/gpu-util/vram fields and one ``GpuSample`` {device_index 0, name, util_percent}: no
health field, as NVML-less or healthy GPUs report) and then one ``metrics`` frame of epoch
0 per rank. A round ends when ``/api/runs/<run>/history`` serves epoch 0 (every frame was
applied before it). What is compared is the broker child's CPU time (all its threads, from
/proc/<pid>/task/*/schedstat) over the round, per frame: on two shared cores the clock moves with the machine's
load, the CPU a frame costs much less. The rate (frames/s) is printed too, for reference.

The other tree is a ``git worktree`` of ``--base`` made in a temporary directory (removed at
the end), run with its own code: ``PYTHONPATH`` and the working directory point at it and
its CLI module is ``python -m rankboard`` where it has one, else ``python -m broker.cli``
(1613263's). Both take ``up --ingest --publish --snapshot --data-dir --port --log-level``.
The frames are encoded by this tree's ``rank_agent.protocol``; 1613263 decodes them alike
(the health fields are omitted when unset).

Trees alternate round by round (this tree first in odd rounds, the base first in even
ones); ``value`` is the median of this tree's rounds over the median of the base's.
``--py-spy DIR`` also records each tree's broker in the last round with py-spy (200 Hz,
raw folded stacks, ``DIR/<tree>.txt``): the profile BENCHMARKS.md cites. The recorder costs
CPU on the same two cores, so that round's figures are printed but not counted.

    python bench/ingest_ab.py --base 1613263 --rounds 4
"""
from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, Senders, http_get, push_all, result

from rank_agent import protocol
from rank_agent.protocol import GpuSample, Metrics, Register, Resources, ResourceSample

RANKS = 64
SENDERS = 2
RUN = "bench-ab"


def frames(sender: int, n: int, senders: int = SENDERS) -> list[bytes]:
    """``n`` resources frames over the sender's share of the ranks (every ``senders``-th),
    then one ``metrics`` frame of epoch 0 per rank (the frames whose record ends the round)."""
    enc = protocol.encoder.encode
    ranks = list(range(sender, RANKS, senders))
    out = []
    for i in range(n):
        util = float(50 + i % 50)
        sample = ResourceSample(cpu_percent=42.5, ram_used_bytes=500 << 30,
                                ram_total_bytes=1 << 40, gpu_util_percent=util,
                                vram_allocated_bytes=(60 << 30) + i, vram_total_bytes=80 << 30,
                                gpus=[GpuSample(device_index=0, name="NVIDIA H100 80GB HBM3",
                                                util_percent=util)])
        out.append(enc(Resources(run=RUN, rank=ranks[i % len(ranks)], sample=sample)))
    for r in ranks:
        out.append(enc(Metrics(run=RUN, rank=r, epoch=0, avg_loss=1.0, batches=100, samples=6400,
                               epoch_ms=1000.0, scalars={"acc": (90.0, 100)})))
    return out


def registers() -> list[bytes]:
    enc = protocol.encoder.encode
    return [enc(Register(run=RUN, rank=r, world_size=RANKS, host=f"node-{r // 8}", local_rank=r % 8,
                         total_epochs=1)) for r in range(RANKS)]


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait(pred: Any, timeout: float, what: str, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(interval)


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far (the ZeroMQ I/O threads too), in
    nanoseconds from /proc/<pid>/task/*/schedstat (/proc's stat ticks are 10 ms: a round
    of ~0.5 s of broker CPU would read to +-2 %)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of ``pid``'s direct children (from /proc: no psutil needed)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(entry.name), cmd))
    return out


def _py_spy() -> str:
    """py-spy from this interpreter's environment, else from PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else "py-spy"


class StartFailed(RuntimeError):
    """``up`` did not come up (a port picked free was taken meanwhile: the machine is shared)."""


class Tree:
    """A source tree of rankboard and how to start its ``up``."""

    def __init__(self, name: str, root: Path, senders: int = SENDERS) -> None:
        self.name = name
        self.root = root
        #: sender processes (connections): each one's receive queue holds INGEST_RCVHWM
        self.senders = senders
        self.module = "rankboard" if (root / "rankboard" / "__main__.py").exists() else "broker.cli"

    def round(self, n: int, profile: Path | None = None) -> dict[str, float]:
        """One round on a fresh ``up`` (fresh data dir): the broker's CPU microseconds per
        frame and the frames/s from release to epoch 0 served; started again (new ports)
        when ``up`` could not start."""
        for _attempt in range(3):
            try:
                return self._round(n, profile)
            except StartFailed as exc:
                print(f"{self.name}: {exc}; starting again", file=sys.stderr, flush=True)
        raise RuntimeError(f"{self.name}: up did not start three times")

    def _round(self, n: int, profile: Path | None) -> dict[str, float]:
        ingest, publish, snapshot, port = _free_ports(4)
        total = self.senders * n + RANKS
        env = dict(os.environ, PYTHONPATH=str(self.root), PYTHONUNBUFFERED="1")
        env.pop("RANKBOARD_TOKEN", None)
        with tempfile.TemporaryDirectory(prefix="rankboard-ab-") as tmp:
            log = open(Path(tmp) / "up.log", "wb")
            up = subprocess.Popen(
                [sys.executable, "-m", self.module, "up",
                 "--ingest", f"tcp://127.0.0.1:{ingest}", "--publish", f"tcp://127.0.0.1:{publish}",
                 "--snapshot", f"tcp://127.0.0.1:{snapshot}", "--data-dir", str(Path(tmp) / "data"),
                 "--port", str(port), "--log-level", "WARNING"],
                cwd=str(self.root), env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT)
            spy = None
            try:
                def web_up() -> bool:
                    if up.poll() is not None:
                        raise StartFailed("up exited: "
                                          + (Path(tmp) / "up.log").read_text()[-2000:])
                    try:
                        return http_get(port, "/healthz", timeout=2)[0] == 200
                    except (OSError, http.client.HTTPException):
                        return False
                _wait(web_up, 60, "the web")
                brokers = [pid for pid, cmd in _children(up.pid) if " broker" in cmd]
                if len(brokers) != 1:
                    raise StartFailed(f"broker child not found: {_children(up.pid)}")
                broker = brokers[0]
                endpoint = f"tcp://127.0.0.1:{ingest}"
                push_all(endpoint, registers())
                _wait(lambda: http_get(port, f"/api/runs/{RUN}")[0] == 200, 30, "the run")
                senders = Senders(endpoint, functools.partial(frames, senders=self.senders),
                                  self.senders, n)
                if profile is not None:
                    spy = subprocess.Popen([_py_spy(), "record", "-p", str(broker), "-r", "200",
                                            "--format", "raw", "-o", str(profile)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)  # attached before the clock starts
                c0 = _cpu_seconds(broker)
                t0 = senders.start()

                def served() -> bool:
                    status, body = http_get(port, f"/api/runs/{RUN}/history")
                    return status == 200 and body.startswith(b"[{")
                _wait(served, 300, "epoch 0 served", interval=0.02)
                dt = time.perf_counter() - t0
                cpu = _cpu_seconds(broker) - c0
                senders.join()
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(30)
                status, body = http_get(port, f"/api/runs/{RUN}")
                if status != 200:
                    raise RuntimeError(f"{self.name}: run header {status}")
            finally:
                if spy is not None and spy.poll() is None:
                    spy.kill()
                up.send_signal(signal.SIGINT)
                try:
                    up.wait(20)
                except subprocess.TimeoutExpired:
                    up.kill()
                    up.wait()
                log.close()
        return {"cpu_us": cpu / total * 1e6, "fps": total / dt}


def _worktree(base: str, into: Path) -> Path:
    path = into / f"rankboard-{base}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path),
                    base], check=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", default="1613263", help="the tree to compare with (a commit)")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="an existing checkout of --base to use instead of a new worktree")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree (default 3)")
    parser.add_argument("--frames", type=int, default=100_000,
                        help="resources frames per sender (default 100,000)")
    parser.add_argument("--senders", type=int, default=SENDERS, choices=(1, 2, 4, 8, 16, 32, 64),
                        help="sender processes, so connections (default 2; a rank's agent is one)")
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                        help="also profile each tree's broker in one extra round (py-spy)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rankboard-ab-trees-") as tmp:
        made = None
        base_root = args.base_dir
        if base_root is None:
            base_root = made = _worktree(args.base, Path(tmp))
        try:
            trees = [Tree("today", REPO, args.senders), Tree(args.base, base_root, args.senders)]
            got: dict[str, list[dict[str, float]]] = {t.name: [] for t in trees}
            for i in range(args.rounds):
                for tree in trees if i % 2 == 0 else trees[::-1]:
                    got[tree.name].append(tree.round(args.frames))
                    print(json.dumps({"round": i, "tree": tree.name,
                                      **{k: round(v, 3) for k, v in got[tree.name][-1].items()}}),
                          file=sys.stderr, flush=True)
            if args.py_spy is not None:
                args.py_spy.mkdir(parents=True, exist_ok=True)
                for tree in trees:
                    one = tree.round(args.frames, profile=args.py_spy / f"{tree.name}.txt")
                    print(json.dumps({"profiled": tree.name, **one}), file=sys.stderr, flush=True)
        finally:
            if made is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(made)],
                               check=False)
    today = statistics.median(r["cpu_us"] for r in got["today"])
    base = statistics.median(r["cpu_us"] for r in got[args.base])
    line = result(f"ingest_cpu_ab_{args.base}", round(today / base, 3), "x", baseline=1.0,
                  ratio=round(today / base, 3),
                  today_cpu_us_per_frame=round(today, 3), base_cpu_us_per_frame=round(base, 3),
                  today_rounds=[round(r["cpu_us"], 2) for r in got["today"]],
                  base_rounds=[round(r["cpu_us"], 2) for r in got[args.base]],
                  today_fps=round(statistics.median(r["fps"] for r in got["today"])),
                  base_fps=round(statistics.median(r["fps"] for r in got[args.base])),
                  frames=args.senders * args.frames + RANKS, senders=args.senders, ranks=RANKS)
    extra = line.pop("_extra", None)
    print(json.dumps({**line, **(extra or {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

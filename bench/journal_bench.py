"""Journal byte figures (issue 19): what the broker's journal writes for frames that change
nothing.

* ``journal_bytes_per_noop_frame``: a run is started (registers, hardware, svg, metadata),
  then the same ``metadata``, ``svg`` and ``register`` frames (and a repeated ``hardware``)
  are sent again and again through :class:`broker.runs.Runs` with the real
  :class:`broker.journal.journal.Journal` wired as the server wires it (``recorder =
  journal.accept``, one ``flush`` per batch); the figure is the journal file's growth
  divided by the number of repeated frames. Target 0 (PROTOCOL 2: the journal keeps no
  frame that changed nothing). ``unknown_key_bytes_per_frame`` in the details: the growth
  per ``metadata`` frame that carries a new 2-byte JSON and a 64 KiB unknown key (the
  journal keeps known fields only, so it is the frame's known size, not 64 KiB).

    python bench/journal_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import result  # noqa: E402

from broker.journal.journal import Journal  # noqa: E402
from broker.runs import Runs  # noqa: E402
from rank_agent import protocol  # noqa: E402
from rank_agent.protocol import Hardware, Metadata, Register, Svg  # noqa: E402

RUN = "noop"


def _size(data_dir: str) -> int:
    return os.path.getsize(os.path.join(data_dir, "runs", f"{RUN}.journal"))


def run(quick: bool = False) -> list[dict[str, Any]]:
    repeats = 200 if quick else 2000
    ranks = 8
    with tempfile.TemporaryDirectory(prefix="rankboard-journal-bench-") as data_dir:
        journal = Journal(data_dir)
        runs = Runs()
        runs.restore(journal.load())
        runs.recorder = journal.accept
        now = time.time()

        def send(raw: bytes) -> None:
            nonlocal now
            now += 0.01
            runs.ingest(raw, now)

        enc = protocol.encoder.encode
        first = [enc(Register(run=RUN, rank=r, world_size=ranks, host=f"h{r // 4}",
                              local_rank=r % 4, port=8600)) for r in range(ranks)]
        first += [enc(Hardware(run=RUN, rank=r, summary=f"cpu | gpu{r}")) for r in range(ranks)]
        first += [enc(Svg(run=RUN, rank=0, svg="<svg/>" * 100, label="net", hash="h")),
                  enc(Metadata(run=RUN, rank=0, json=json.dumps({"lr": 0.1, "bs": 64})))]
        for raw in first:
            send(raw)
        journal.flush()
        before = _size(data_dir)
        noops = first  # every one of them again: each changes nothing now
        sent = 0
        for _ in range(repeats // len(noops) + 1):
            for raw in noops:
                send(raw)
                sent += 1
            journal.flush()
        noop_bytes = (_size(data_dir) - before) / sent

        before = _size(data_dir)
        junk = "x" * 65536
        for i in range(50):
            send(msgspec.msgpack.encode({"type": "metadata", "run": RUN, "rank": 0,
                                         "json": str(i % 10), "junk": junk}))
            journal.flush()
        unknown_bytes = (_size(data_dir) - before) / 50
        journal.close()
    return [result("journal_bytes_per_noop_frame", round(noop_bytes, 3), "B/frame",
                   frames=sent, unknown_key_bytes_per_frame=round(unknown_bytes, 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in run(args.quick):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A simulated Flight Recorder for ``rankboard demo``'s step job (issue 43 item 1).

The demo's ranks run no torch, so the agent's Flight Recorder reader
(:mod:`rank_agent.flightrec`) finds none and the demo never showed the answer the README
leads with: "rank N has not entered all_reduce #k". This gives each demo rank the dump a
real recorder gives a data-parallel job, in the JSON shape ``_dump_fr_trace_json`` returns
(``pg_config``, ``pg_status`` with its numbers as strings, ``entries``), so the agent reads
it, builds and sends the ``collectives`` frame exactly as it does for a real job, and the
broker forms its verdict from the same wire: one gradient all-reduce per optimizer step on
the default group (``collective_seq_id`` = step + 1). A rank is *enqueued* at a step's
collective once it reaches it and *completed* once every rank has; the rank whose data
loader hangs never reaches it, so its numbers stay one behind the others'.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List

__all__ = ["SimulatedRecorder", "use_simulated_recorder", "BUCKET_NUMEL", "KEPT"]

#: Elements in the demo model's one gradient bucket (a ~25M-parameter model in bf16 buckets
#: of 25 MiB, as DDP's default bucket_cap_mb gives).
BUCKET_NUMEL = 13_107_200
#: Entries the simulated ring keeps (a real one keeps 2,000; the agent sends the newest 64).
KEPT = 16


class SimulatedRecorder:
    """One rank's recorder: the step loop calls :meth:`enter` when the rank reaches a step's
    all-reduce and :meth:`complete` when the step's collective is done; the agent's thread
    calls :meth:`read` (hence the lock)."""

    def __init__(self, world_size: int, backend: str = "nccl") -> None:
        self.world_size = world_size
        self.op = f"{backend}:all_reduce"
        self.enqueued = 0
        self.completed = 0
        self._created: Dict[int, int] = {}
        self._lock = threading.Lock()

    def enter(self, seq: int) -> None:
        with self._lock:
            self.enqueued = max(self.enqueued, seq)
            self._created[seq] = time.time_ns()
            for old in [s for s in self._created if s <= seq - KEPT]:
                del self._created[old]

    def complete(self, seq: int) -> None:
        with self._lock:
            self.completed = max(self.completed, seq)

    def read(self) -> Dict[str, Any]:
        """The dump, decoded, as :func:`rank_agent.flightrec.read_trace` returns one."""
        with self._lock:
            entries: List[Dict[str, Any]] = []
            for seq in sorted(self._created):
                done = seq <= self.completed
                entries.append({
                    "record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
                    "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
                    "profiling_name": self.op, "time_created_ns": self._created[seq],
                    "input_sizes": [[BUCKET_NUMEL]], "input_dtypes": ["BFloat16"],
                    "output_sizes": [[BUCKET_NUMEL]], "output_dtypes": ["BFloat16"],
                    "state": "completed" if done else "scheduled", "retired": done,
                    "is_p2p": False, "timeout_ms": 600_000,
                })
            ranks = ", ".join(str(r) for r in range(self.world_size))
            return {
                "version": "2.10",
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": f"[{ranks}]"}},
                "pg_status": {"0": {"last_enqueued_collective": str(self.enqueued),
                                    "last_started_collective": str(self.enqueued),
                                    "last_completed_collective": str(self.completed)}},
                "entries": entries,
            }


def use_simulated_recorder(recorder: SimulatedRecorder) -> None:
    """Make this process's agents read ``recorder`` instead of torch's.

    The agent keeps one reader per process and has no public way to replace it; the demo
    is its own package's code (as :func:`rankboard.demogpu.use_simulated_gpu` sets the
    sampler), so it sets the reader's slot directly. Only demo rank processes call this."""
    from rank_agent import flightrec

    flightrec._RECORDER._read = recorder.read

"""Hostile ``collectives`` frames (PROTOCOL.md section 7.2) for the ingest fuzz
(:mod:`tests.support.fuzzgen` mixes :class:`CollectiveFuzz` into its generators): valid
frames with every bound met now and then (64 groups, 64 entries a group, 128-character
strings, 16 x 16 sizes, numbers at the ends of int64, odd floats), and frames with one defect
each (a bound passed by one, a wrong type, an unknown reason, a missing field), which must be
rejected as ``schema`` and change nothing."""
from __future__ import annotations

from typing import Any

from rank_agent import protocol
from tests.support.fuzzkit import FuzzKit
from tests.support.fuzzruns import CHECK_RUN, CHECK_WORLD, HOSTILE_RUNS

__all__ = ["CollectiveFuzz"]

G = protocol.MAX_COLLECTIVE_GROUPS
E = protocol.MAX_COLLECTIVE_ENTRIES
T = protocol.MAX_COLLECTIVE_TEXT
DIMS = protocol.MAX_SIZE_DIMS
SIZES = protocol.MAX_ENTRY_SIZES
INTS = (0, -1, 1, 2**63 - 1, -(2**63), 2501)


class CollectiveFuzz(FuzzKit):
    """Mixed into the fuzz's ``_Hostile`` (its state: :class:`~tests.support.fuzzkit.FuzzKit`)."""

    def _pg(self) -> str:
        rng = self.rng
        return rng.choice(("0", "1", "17", "", self.text(rng.randrange(0, 12))))

    def collectives_dict(self, run: str, rank: int) -> dict[str, Any]:
        """A valid ``collectives`` frame as a dict; now and then one bound met exactly."""
        rng = self.rng
        d = self._dump_head("collectives", run, rank)
        pgs = list({self._pg() for _ in range(rng.randrange(0, 4))})
        d["groups"] = [{"pg": pg, "desc": self.text(rng.randrange(0, 20)),
                        "size": rng.choice((0, 3, 2**40)),
                        "last_enqueued": rng.choice(INTS), "last_completed": rng.choice(INTS)}
                       for pg in pgs]
        d["entries"] = [{"pg": rng.choice(pgs + [self._pg()]), "seq": rng.choice(INTS),
                         "op": rng.choice(("gloo:all_reduce", "nccl:broadcast", self.text(9))),
                         "input_sizes": [[rng.choice(INTS) for _ in range(rng.randrange(0, 3))]
                                         for _ in range(rng.randrange(0, 3))],
                         "state": rng.choice(("", "scheduled", "completed")),
                         "retired": rng.random() < 0.5}
                        for _ in range(rng.randrange(0, 8))]
        edge = rng.random()
        if edge < 0.03:
            d["groups"] = [{"pg": str(i)} for i in range(G)]
            d["entries"] = [{"pg": str(i % G), "seq": i, "op": "x"} for i in range(G * 2)]
        elif edge < 0.06:
            d["groups"] = [{"pg": "0"}]
            d["entries"] = [{"pg": "0", "seq": i, "op": "\U0001f600" * T,
                             "input_sizes": [[2**62] * DIMS] * SIZES} for i in range(E)]
        elif edge < 0.08:
            big = "\u4e2d" * T  # characters, not bytes
            d["groups"] = [{"pg": big, "desc": big}]
            d["entries"] = [{"pg": big, "seq": 1, "op": big, "state": big}]
        return self._maybe_extra_key(d)

    def valid_collectives(self) -> Any:
        """A valid collectives frame for a hostile run (it may list a verdict: news)."""
        return self._frame(self.collectives_dict(self.run(), self.rank()), "accept", "valid_collectives")

    def bad_collectives(self) -> Any:
        """A collectives frame with one defect; for the check run too (changes nothing)."""
        rng = self.rng
        d = self.collectives_dict(rng.choice(HOSTILE_RUNS + [CHECK_RUN]), rng.randrange(CHECK_WORLD))
        d.pop("unknown_extra_key", None)
        defect = rng.choice(("groups", "entries_per_group", "pg", "desc", "op", "state",
                             "dims", "sizes", "seq", "size", "reason", "request_id",
                             "taken_at", "retired", "shape"))
        if defect == "groups":
            d["groups"] = [{"pg": str(i)} for i in range(G + 1)]
        elif defect == "entries_per_group":
            d["entries"] = [{"pg": "0", "seq": i, "op": "x"} for i in range(E + 1)]
        elif defect in ("pg", "desc"):
            d["groups"] = [{"pg": "0", defect: "p" * (T + 1)}]
        elif defect in ("op", "state"):
            d["entries"] = [{"pg": "0", "seq": 1, "op": "x", defect: "\u00e9" * (T + 1)}]
        elif defect == "dims":
            d["entries"] = [{"pg": "0", "seq": 1, "op": "x", "input_sizes": [[1] * (DIMS + 1)]}]
        elif defect == "sizes":
            d["entries"] = [{"pg": "0", "seq": 1, "op": "x", "input_sizes": [[1]] * (SIZES + 1)}]
        elif defect == "seq":
            d["entries"] = [{"pg": "0", "seq": rng.choice(("7", 1.5, None)), "op": "x"}]
        elif defect == "size":
            d["groups"] = [{"pg": "0", "size": rng.choice((-1, "3", 1.5))}]
        elif defect == "reason":
            d["reason"] = rng.choice(("", "profile", "STALL", 1, None))
        elif defect == "request_id":
            d["request_id"] = "r" * (protocol.MAX_REQUEST_ID + 1)
        elif defect == "taken_at":
            if rng.random() < 0.5:
                d.pop("taken_at")
            else:
                d["taken_at"] = rng.choice(("now", None, [1.0]))
        elif defect == "retired":
            d["entries"] = [{"pg": "0", "seq": 1, "op": "x", "retired": rng.choice(("no", 2))}]
        else:
            d[rng.choice(("groups", "entries"))] = rng.choice(({"pg": "0"}, "x", [["0", 1]], [None]))
        return self._frame(d, "schema", "bad_collectives")

"""Hostile and valid ``stacks`` frames (PROTOCOL.md section 2.5) for the ingest fuzz
(:mod:`tests.support.fuzzgen` mixes :class:`StackFuzz` into its generators): valid stall
dumps, request answers and profiles (weird text, non-finite times, every limit met exactly)
and frames with one defect each (a limit passed by one, a wrong type, an unknown reason, a
missing field), which must be rejected as ``schema`` and change nothing."""
from __future__ import annotations

from typing import Any

from rank_agent import protocol
from tests.support.fuzzkit import FuzzKit
from tests.support.fuzzruns import CHECK_RUN, CHECK_WORLD, HOSTILE_RUNS

__all__ = ["StackFuzz"]

class StackFuzz(FuzzKit):
    """Mixed into the fuzz's ``_Hostile`` (its state: :class:`~tests.support.fuzzkit.FuzzKit`)."""

    def _stack_frames(self, n: int) -> list[dict[str, Any]]:
        rng = self.rng
        return [{"file": self.text(rng.randrange(0, 40)), "line": rng.choice((0, 1, -1, 2**63 - 1)),
                 "function": rng.choice(("all_reduce", "<module>", "__next__", self.text(12))),
                 "code": self.text(rng.randrange(0, 30))} for _ in range(n)]

    def stacks_dict(self, run: str, rank: int) -> dict[str, Any]:
        """A valid ``stacks`` frame as a dict; now and then one limit met exactly."""
        rng = self.rng
        d = self._dump_head("stacks", run, rank)
        reason = d["reason"]
        if rng.random() < 0.7:
            d["idle_s"] = self.weird_float() if rng.random() < 0.3 else rng.uniform(0, 1e4)
        threads = [{"name": self.text(rng.randrange(0, 20)), "main": i == 0,
                    "frames": self._stack_frames(rng.randrange(0, 8))}
                   for i in range(rng.randrange(0, 4))]
        if threads or rng.random() < 0.5:
            d["threads"] = threads
        if reason == "request" and rng.random() < 0.3:
            d["profile"] = [{"stack": [self.text(20) for _ in range(rng.randrange(0, 5))],
                             "count": rng.choice((1, 7, 2**63 - 1))}
                            for _ in range(rng.randrange(0, 5))]
            d["samples"] = rng.randrange(0, 10**6)
            d["seconds"] = self.weird_float()
        edge = rng.random()
        if edge < 0.02:
            d["threads"] = [{"name": "t", "frames": self._stack_frames(1)}
                            for _ in range(protocol.MAX_STACK_THREADS)]
        elif edge < 0.04:
            d["threads"] = [{"name": "t", "main": True,
                             "frames": self._stack_frames(protocol.MAX_STACK_FRAMES)}]
        elif edge < 0.06:
            big = "\U0001f600" * protocol.MAX_STACK_TEXT  # characters, not bytes
            d["threads"] = [{"name": big, "frames": [{"file": big, "line": 1, "function": big,
                                                      "code": big}]}]
        elif edge < 0.07:
            d["profile"] = [{"stack": ["f (a.py:1)"], "count": 1}
                            for _ in range(protocol.MAX_PROFILE_ENTRIES)]
        elif edge < 0.08:
            d["profile"] = [{"stack": ["f (a.py:1)"] * protocol.MAX_PROFILE_DEPTH, "count": 2}]
        return self._maybe_extra_key(d)

    def valid_stacks(self) -> Any:
        """A valid stacks frame for a hostile run (it may stall a rank: news, not harm)."""
        return self._frame(self.stacks_dict(self.run(), self.rank()), "accept", "valid_stacks")

    def bad_stacks(self) -> Any:
        """A stacks frame with one defect (a limit passed by one, a wrong type, an unknown
        reason, a missing field), for a hostile run or the check run (must change nothing)."""
        rng = self.rng
        run = rng.choice(HOSTILE_RUNS + [CHECK_RUN])
        d = self.stacks_dict(run, rng.randrange(CHECK_WORLD))
        d.pop("unknown_extra_key", None)
        defect = rng.choice(("threads", "frames", "file", "function", "code", "name",
                             "profile", "depth", "count", "request_id", "reason", "taken_at",
                             "line", "main", "stack_type"))
        if defect == "threads":
            d["threads"] = [{"name": "t", "frames": []}
                            for _ in range(protocol.MAX_STACK_THREADS + 1)]
        elif defect == "frames":
            d["threads"] = [{"name": "t",
                             "frames": self._stack_frames(protocol.MAX_STACK_FRAMES + 1)}]
        elif defect in ("file", "function", "code"):
            frame = self._stack_frames(1)[0]
            frame[defect] = "\u00e9" * (protocol.MAX_STACK_TEXT + 1)
            d["threads"] = [{"name": "t", "frames": [frame]}]
        elif defect == "name":
            d["threads"] = [{"name": "n" * (protocol.MAX_STACK_TEXT + 1), "frames": []}]
        elif defect == "profile":
            d["profile"] = [{"stack": [], "count": 1}
                            for _ in range(protocol.MAX_PROFILE_ENTRIES + 1)]
        elif defect == "depth":
            d["profile"] = [{"stack": ["f"] * (protocol.MAX_PROFILE_DEPTH + 1), "count": 1}]
        elif defect == "count":
            d["profile"] = [{"stack": ["f"], "count": rng.choice((0, -1, 1.5))}]
        elif defect == "request_id":
            d["request_id"] = "r" * (protocol.MAX_REQUEST_ID + 1)
        elif defect == "reason":
            d["reason"] = rng.choice(("", "profile", "STALL", 1, None))
        elif defect == "taken_at":
            if rng.random() < 0.5:
                d.pop("taken_at")
            else:
                d["taken_at"] = rng.choice(("now", None, [1.0]))
        elif defect == "line":
            d["threads"] = [{"name": "t", "frames": [{"file": "f", "line": rng.choice(
                ("1", 1.5, None, True)), "function": "g"}]}]
        elif defect == "main":
            d["threads"] = [{"name": "t", "main": rng.choice(("yes", 1, None)), "frames": []}]
        else:
            d["threads"] = rng.choice(({"name": "t"}, "threads", [["t", []]], [None]))
        return self._frame(d, "schema", "bad_stacks")

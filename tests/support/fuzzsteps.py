"""Hostile and valid ``steps`` frames (PROTOCOL.md section 2.4, with v4's ``data_ms``) for the
ingest fuzz (:mod:`tests.support.fuzzgen` mixes :class:`StepFuzz` into its generators): valid
frames with NaN/inf/None values, huge steps and integers and odd metric names, the data wait
null, non-finite, negative or huge; frames with one defect each (unequal lengths,
non-increasing or no steps, 1,025 points, 65 names, long names, None times, wrong types,
integers past their bounds: ``steps_shape`` or ``schema``); and a run driven past 1,024
distinct metric names (``step_metric_names``)."""
from __future__ import annotations

import math
from typing import Any

from rank_agent import protocol
from tests.support.fuzzkit import FuzzKit
from tests.support.fuzzruns import (
    CHECK_STEPS_RUN,
    CHECK_STEPS_WORLD,
    HOSTILE_RUNS,
    HOSTILE_WORLD,
    NAMES_RUN,
)

__all__ = ["StepFuzz"]


class StepFuzz(FuzzKit):
    """Mixed into the fuzz's ``_Hostile`` (its state: :class:`~tests.support.fuzzkit.FuzzKit`),
    also its ``name_pool`` (odd metric names, few enough to stay under the run's cap) and
    ``name_frames`` (frames sent to :data:`NAMES_RUN` so far)."""

    name_pool: list[str]
    name_frames: int

    def _opt_float(self) -> Any:
        """A step metric value: None, a weird float, or an integer (msgspec takes any
        MessagePack integer as a float, 2**64 - 1 included)."""
        r = self.rng.random()
        if r < 0.25:
            return None
        if r < 0.35:
            return self.rng.choice((0, 1, -1, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1))
        return self.weird_float()

    def _wait(self) -> Any:
        """A ``data_ms`` value the schema takes: None or a number >= 0, now and then at the
        ends of the floats (1e307 over a ``step_ms`` of 1 overflowed a percentage, issue
        38). A negative or NaN wait is a :meth:`bad_steps` defect."""
        r = self.rng.random()
        if r < 0.25:
            return None
        if r < 0.45:
            return self.rng.choice((0, 0.0, -0.0, 1e307, 1e308, math.inf, 5e-324, 2**64 - 1))
        return self.rng.uniform(0.0, 1e6)

    def steps_dict(self, run: str, rank: int, *, n: int | None = None) -> dict[str, Any]:
        """A valid ``steps`` frame as a dict: strictly increasing steps (up to the largest
        int64), every list as long as ``steps``, [] for samples/tokens not sent."""
        rng = self.rng
        if n is None:
            n = rng.choice((1, 1, 2, 5, 10, 30)) if rng.random() < 0.97 else \
                rng.choice((200, protocol.MAX_STEP_POINTS))
        top = protocol.MAX_STEP
        r = rng.random()
        if r < 0.8:
            start = rng.randrange(300)
        elif r < 0.9:
            start = rng.randrange(2**62)
        else:
            start = top - n + 1  # the last step is the largest int64
        steps = list(range(start, start + n))
        if r < 0.8 and n > 1 and rng.random() < 0.5:  # gaps
            steps = sorted(rng.sample(range(start, start + 3 * n), n))
        d: dict[str, Any] = {
            "type": "steps", "run": run, "rank": rank, "steps": steps,
            "times": [self.weird_float() if rng.random() < 0.2 else 1.7e9 + s % 10**6
                      for s in steps],
            "step_ms": [self._opt_float() for _ in steps],
        }
        for key in ("samples", "tokens"):
            if rng.random() < 0.6:
                d[key] = [rng.choice((0, 1, 64, 4096, protocol.MAX_STEP_COUNT)) for _ in steps]
        if rng.random() < 0.5:  # the data wait (7.1): nulls, infinite, huge, tiny (>= 0)
            d["data_ms"] = [self._wait() for _ in steps]
        names = rng.choice((0, 1, 2, 4)) if rng.random() < 0.98 else protocol.MAX_STEP_METRICS
        metrics: dict[str, list[Any]] = {}
        for i in range(names):
            name = rng.choice(("loss", "lr", "acc", f"m{i}", rng.choice(self.name_pool),
                               "\u00e9" * protocol.MAX_STEP_METRIC_NAME, "a,b\"c\r\n"))
            metrics[name] = [self._opt_float() for _ in steps]
        if metrics or rng.random() < 0.5:
            d["metrics"] = metrics
        return self._maybe_extra_key(d)

    def valid_steps(self) -> Any:
        """A valid steps frame for a hostile run: NaN/inf/None values, huge steps and
        integers, weird metric names. Its points may be late (counted, not rejected)."""
        return self._frame(self.steps_dict(self.run(), self.rank()), "accept", "valid_steps")

    def bad_steps(self) -> Any:
        """A steps frame with one defect, for a hostile run or the check steps run (where
        it must change nothing)."""
        rng = self.rng
        run = rng.choice(HOSTILE_RUNS + [CHECK_STEPS_RUN])
        world = CHECK_STEPS_WORLD if run == CHECK_STEPS_RUN else HOSTILE_WORLD
        d = self.steps_dict(run, rng.randrange(world), n=rng.randrange(2, 12))
        if len(d.get("metrics", {})) > 4:  # keep the name limit out of the other defects
            d["metrics"] = dict(list(d["metrics"].items())[:4])
        n = len(d["steps"])
        defect = rng.choice(("unequal", "unequal", "unequal", "not_increasing", "empty",
                             "too_many", "names", "long_name", "none_time", "wrong_type",
                             "huge", "negative"))
        shape, schema = "steps_shape", "schema"
        if defect == "unequal":
            key = rng.choice(("times", "step_ms", "samples", "tokens", "metric", "data_ms"))
            m = n + 1 if rng.random() < 0.5 else n - 1  # n >= 2: never 0 ("not sent")
            if key == "metric":
                d.setdefault("metrics", {})[rng.choice(("loss", "x"))] = [1.0] * m
            elif key in ("times", "step_ms", "data_ms"):
                d[key] = [1.0] * m
            else:
                d[key] = [1] * m
            return self._frame(d, shape, "bad_steps")
        if defect == "not_increasing":
            steps = d["steps"]
            i = rng.randrange(1, n)
            steps[i] = steps[i - 1] if rng.random() < 0.5 else max(0, steps[i - 1] - 1)
            return self._frame(d, shape, "bad_steps")
        if defect == "empty":
            d.update(steps=[], times=[], step_ms=[])
            d.pop("samples", None)
            d.pop("tokens", None)
            d.pop("metrics", None)
        elif defect == "too_many":
            k = protocol.MAX_STEP_POINTS + 1
            d.update(steps=list(range(k)), times=[1.0] * k, step_ms=[None] * k)
            d.pop("samples", None)
            d.pop("tokens", None)
            d.pop("metrics", None)
        elif defect == "names":
            d["metrics"] = {f"n{i}": [1.0] * n for i in range(protocol.MAX_STEP_METRICS + 1)}
        elif defect == "long_name":
            d["metrics"] = {"\u4e2d" * (protocol.MAX_STEP_METRIC_NAME + 1): [1.0] * n}
        elif defect == "none_time":
            d["times"][rng.randrange(n)] = None
        elif defect == "wrong_type":
            key = rng.choice(("steps", "times", "step_ms", "samples", "metrics", "metric",
                              "list", "data_ms"))
            bad = rng.choice(("x", b"\x00", [1], {"a": 1}, True))
            if key == "metrics":
                d["metrics"] = rng.choice(([1.0] * n, "loss", 1.0))
            elif key == "metric":
                d["metrics"] = {"loss": [bad] * n}
            elif key == "list":
                d[rng.choice(("steps", "times", "step_ms"))] = rng.choice((1.0, "abc", None))
            elif key == "samples":
                d["samples"] = [rng.choice((1.5, "1", True))] * n
            elif key == "data_ms":
                d["data_ms"] = rng.choice(([bad] * n, "x", 1.0, {"a": [1.0] * n}))
            elif key == "steps":
                d["steps"][rng.randrange(n)] = rng.choice((1.5, "1", None, True))
            else:
                d[key][rng.randrange(n)] = bad
        elif defect == "huge":
            key = rng.choice(("steps", "samples", "tokens"))
            if key == "steps":
                d["steps"][-1] = rng.choice((protocol.MAX_STEP + 1, 2**64 - 1))
            else:
                d[key] = [0] * (n - 1) + [rng.choice((protocol.MAX_STEP_COUNT + 1,
                                                      2**63, 2**64 - 1))]
        else:  # negative
            key = rng.choice(("steps", "samples", "tokens", "data_ms"))
            if key == "data_ms":  # a wait < 0 or NaN (issue 38: a negative data_share)
                d["data_ms"] = [1.0] * n
                d["data_ms"][rng.randrange(n)] = rng.choice((-1.0, -1e-300, -math.inf, math.nan))
            elif key == "steps":
                d["steps"][0] = -rng.randrange(1, 2**63)
            else:
                d[key] = [-1] * n
        return self._frame(d, schema, "bad_steps")

    def step_names(self) -> Any:
        """A steps frame of :data:`NAMES_RUN` with 64 metric names it has not seen: accepted
        while the run holds at most 1,024 distinct names, then rejected (one PUSH socket
        keeps the order, so the outcome is known by construction)."""
        i = self.name_frames
        self.name_frames += 1
        per = protocol.MAX_STEP_METRICS
        d = {"type": "steps", "run": NAMES_RUN, "rank": 0, "steps": [i], "times": [1.7e9],
             "step_ms": [1.0], "metrics": {f"n{i}_{j}_" + "x" * 100: [1.0] for j in range(per)}}
        ok = (i + 1) * per <= 1024
        return self._frame(d, "accept" if ok else "step_metric_names", "step_names")

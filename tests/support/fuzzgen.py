"""A seeded generator of hostile ingest traffic (the harness that pushes it through a real
broker's PULL socket and checks the outcome is ``tests/support/fuzzrun.py``).

Every generated message carries what it must do, as a set of outcomes known *by
construction* (not by asking the decoder): ``"accept"`` or reject reasons
(docs/PROTOCOL.md section 7). Most have exactly one; a few are honestly ambiguous (random bytes may
decode to a wrong-shaped value: ``decode`` or ``schema``; JSON nested 500 deep may or may
not fit the recursion limit: ``accept`` or ``bad_metadata_json``). The harness then checks, per outcome,
``#frames that must have it <= counter <= #frames that may have it``, that every frame is
counted exactly once, and that the broker never dies (``fuzzrun.py``).

Valid traffic is checkable: a dedicated run (:data:`CHECK_RUN`, 3 ranks) whose epochs all
close with losses known in advance, interleaved with the hostile frames (some of which
target that run and must be rejected without effect), then finished. Its records at the end
must be exactly the expected ones: a valid frame lost or a rejected one applied shows there.

Closed steps are checkable the same way: a second dedicated run (:data:`CHECK_STEPS_RUN`, 3
ranks) logs ``steps`` frames whose every point is known in advance (NaN losses, sparse
metrics and ties for the slowest rank included) and finishes; every step must close exactly
once with the figures of PROTOCOL 2.4, computed here by brute force. Hostile ``steps`` frames
(unequal lengths, non-increasing steps, empty, 1025 points, 65 names, long names, None times,
wrong types, integers past their bounds) must be rejected as ``steps_shape`` or ``schema``;
valid ones with NaN/inf, huge steps and huge integers go to the hostile runs. Contract v3
adds run ids with a trailing newline or made of dots (``schema``), metadata with a lone
surrogate escape (``bad_metadata_json``) and a run (:data:`NAMES_RUN`) driven past 1,024
distinct step metric names (``step_metric_names``). Contract v3's ``stacks`` frames come
valid (stall dumps, request answers, profiles; weird text, non-finite times, every limit
met exactly) and hostile (every limit passed by one, wrong types, an unknown reason: all
``schema``). Contract v4's fields come both ways too: ``steps`` frames carry ``data_ms``
(nulls, infinite, huge; as long as ``steps`` or not, of the wrong type; a negative or NaN
wait is ``schema``, issue 38) and registers a
``label`` (hostile text up to 128 characters; 129, or not a string: ``schema``); the
``collectives`` frames are :mod:`tests.support.fuzzcollectives`'.

Used by ``tests/reliability/test_fuzz.py`` (a quick run) and ``bench/fuzz_ingest.py``
(>= 100 000 frames).
"""
from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass
from typing import Any

import msgspec

from rank_agent import protocol
from tests.support.fuzzcollectives import CollectiveFuzz
from tests.support.fuzzruns import (  # noqa: F401 - the harness reads them here
    CHECK_RUN,
    CHECK_STEP_BLOCK,
    CHECK_STEPS_RUN,
    CHECK_STEPS_WORLD,
    CHECK_WORLD,
    HOSTILE_RUNS,
    HOSTILE_WORLD,
    NAMES_RUN,
    NEW_RUN_PREFIX,
)
from tests.support.fuzzstacks import StackFuzz
from tests.support.fuzzsteps import StepFuzz

_enc = msgspec.msgpack.Encoder()
_NONFINITE = (math.nan, math.inf, -math.inf)
MiB = 1024 * 1024


@dataclass(frozen=True)
class Msg:
    data: bytes
    expect: frozenset[str]
    kind: str  # the generator that made it (for reports)


def one(outcome: str) -> frozenset[str]:
    return frozenset((outcome,))


def _accepted(d: dict[str, Any]) -> frozenset[str]:
    """What a valid frame for a hostile run does: accepted, except that a metrics frame for
    a high epoch may find the run's open epochs at the cap (``open_epochs``, which depends
    on the traffic before it: high epochs of a hostile run never close)."""
    if d.get("type") == "metrics" and d.get("epoch", 0) >= 30:
        return frozenset(("accept", "open_epochs"))
    return one("accept")


def check_loss(epoch: int, rank: int) -> float:
    return 1.0 / (epoch + 1) + 0.25 * rank


def check_batches(rank: int) -> int:
    return rank + 1


def expected_check_losses(epochs: int) -> list[float]:
    """The record loss of every epoch of :data:`CHECK_RUN` (batch-weighted mean, PROTOCOL 2.3)."""
    out = []
    for e in range(epochs):
        num = sum(check_loss(e, r) * check_batches(r) for r in range(CHECK_WORLD))
        out.append(num / sum(check_batches(r) for r in range(CHECK_WORLD)))
    return out


def _check_registers(epochs: int) -> list[Msg]:
    """In the preamble: hostile frames aimed at the check run must find its world size."""
    return [Msg(_enc.encode(protocol.Register(run=CHECK_RUN, rank=r, world_size=CHECK_WORLD,
                                              host=f"node-{r}", total_epochs=epochs)),
                one("accept"), "check") for r in range(CHECK_WORLD)]


def _check_script(epochs: int) -> list[Msg]:
    accept = one("accept")
    msgs: list[Msg] = []
    for e in range(epochs):
        for r in range(CHECK_WORLD):
            msgs.append(Msg(_enc.encode(protocol.Metrics(
                run=CHECK_RUN, rank=r, epoch=e, avg_loss=check_loss(e, r),
                batches=check_batches(r), samples=10 * (r + 1), epoch_ms=5.0,
                scalars={"acc": (0.5, 1)})), accept, "check"))
    msgs += [Msg(_enc.encode(protocol.Finish(run=CHECK_RUN, rank=r)), accept, "check")
             for r in range(CHECK_WORLD)]
    return msgs


def check_step_point(step: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of :data:`CHECK_STEPS_RUN` logs at ``step``."""
    return {
        "time": 1e9 + step + 0.25 * ((step + rank) % 3),  # the latest is any rank's
        # the slowest rank varies, with ties (between ranks 1 and 2 every 4th step)
        "step_ms": 100.0 + 10.0 * ((step + rank) % 3 == 0) + 20.0 * (rank > 0 and step % 4 == 0),
        "samples": 8 * (rank + 1),
        "tokens": 1024,
        "loss": math.nan if (rank == 1 and step % 97 == 13) else 1.0 / (step + 1) + 0.125 * rank,
        "lr": 1e-3 * (rank + 1) if step % 2 == 0 else None,
        "grad_norm": float(step % 13) if (rank == 2 and step % 5 == 0) else None,
    }


def _check_steps_registers() -> list[Msg]:
    return [Msg(_enc.encode(protocol.Register(run=CHECK_STEPS_RUN, rank=r,
                                              world_size=CHECK_STEPS_WORLD, host=f"node-{r}")),
                one("accept"), "check_steps") for r in range(CHECK_STEPS_WORLD)]


def _check_steps_script(blocks: int) -> list[Msg]:
    """``blocks`` frames of :data:`CHECK_STEP_BLOCK` points per rank, round-robin by block,
    then a finish per rank (the run end closes whatever is still open)."""
    accept = one("accept")
    msgs: list[Msg] = []
    for b in range(blocks):
        steps = list(range(b * CHECK_STEP_BLOCK, (b + 1) * CHECK_STEP_BLOCK))
        for r in range(CHECK_STEPS_WORLD):
            pts = [check_step_point(s, r) for s in steps]
            metrics = {name: [p[name] for p in pts] for name in ("loss", "lr", "grad_norm")}
            msgs.append(Msg(_enc.encode(protocol.Steps(
                run=CHECK_STEPS_RUN, rank=r, steps=steps, times=[p["time"] for p in pts],
                step_ms=[p["step_ms"] for p in pts], samples=[p["samples"] for p in pts],
                tokens=[p["tokens"] for p in pts], metrics=metrics)), accept, "check_steps"))
    msgs += [Msg(_enc.encode(protocol.Finish(run=CHECK_STEPS_RUN, rank=r)), accept,
                 "check_steps") for r in range(CHECK_STEPS_WORLD)]
    return msgs


def _triple(values: list[float]) -> list[float]:
    """``[mean, min, max]`` of PROTOCOL 2.4 (NaN for null), by brute force."""
    finite = [v for v in values if math.isfinite(v)]
    mean = math.fsum(values) / len(values) if len(finite) == len(values) else math.nan
    return [mean, min(finite) if finite else math.nan, max(finite) if finite else math.nan]


def expected_check_steps(blocks: int) -> list[dict[str, Any]]:
    """Every closed step of :data:`CHECK_STEPS_RUN`, by brute force over PROTOCOL 2.4:
    ``{step, time, n, metrics: {name: [mean, min, max]}, step_ms, slowest_rank, samples,
    tokens, samples_per_s}`` (NaN for null)."""
    out = []
    for step in range(blocks * CHECK_STEP_BLOCK):
        pts = [check_step_point(step, r) for r in range(CHECK_STEPS_WORLD)]
        ms = [p["step_ms"] for p in pts]
        top = max(ms)
        metrics = {}
        for name in ("grad_norm", "loss", "lr"):
            vals = [p[name] for p in pts if p[name] is not None]
            if vals:
                metrics[name] = _triple(vals)
        samples = sum(p["samples"] for p in pts)
        out.append({"step": step, "time": max(p["time"] for p in pts), "n": len(pts),
                    "metrics": metrics, "step_ms": _triple(ms),
                    "slowest_rank": ms.index(top), "samples": samples,
                    "tokens": sum(p["tokens"] for p in pts),
                    "samples_per_s": samples / (top / 1000.0)})
    return out


def check_steps_blocks(msgs: list[Msg]) -> int:
    """How many blocks of :data:`CHECK_STEPS_RUN` steps ``msgs`` carry (frames, less the
    registers and the finishes, per rank)."""
    n = sum(1 for m in msgs if m.kind == "check_steps")
    return max(0, n - 2 * CHECK_STEPS_WORLD) // CHECK_STEPS_WORLD


class _Hostile(StepFuzz, StackFuzz, CollectiveFuzz):
    """The hostile generators; each returns one :class:`Msg` (``steps``, ``stacks`` and
    ``collectives`` frames: :mod:`tests.support.fuzzsteps`, :mod:`~tests.support.fuzzstacks`,
    :mod:`~tests.support.fuzzcollectives`)."""

    def _msg(self, data: bytes, outcome: str, kind: str) -> Msg:
        return Msg(data, one(outcome), kind)

    def __init__(self, rng: random.Random, big: bool) -> None:
        self.rng = rng
        self.big = big  # allow the multi-MiB frames
        self.new_runs = 0
        self.name_frames = 0
        # Hostile runs draw their odd step metric names from this pool, so they stay under
        # the per-run cap of distinct names (the cap has its own generator, step_names).
        self.name_pool = [self.text(rng.randrange(1, 20)) for _ in range(64)]

    # -- helpers ---------------------------------------------------------------------
    def run(self) -> str:
        return self.rng.choice(HOSTILE_RUNS)

    def rank(self) -> int:
        return self.rng.randrange(HOSTILE_WORLD)

    def epoch(self) -> int:
        return self.rng.randrange(30) if self.rng.random() < 0.95 else self.rng.randrange(2**40)

    def weird_float(self) -> float:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(_NONFINITE)
        if r < 0.7:
            return self.rng.choice((0.0, -0.0, 1e308, -1e308, 5e-324))
        return self.rng.uniform(-1e6, 1e6)

    def text(self, n: int) -> str:
        alphabet = string.printable + "\u00e9\u4e2d\U0001f600\u202e<>&\"'"
        return "".join(self.rng.choice(alphabet) for _ in range(n))

    def sample(self) -> dict[str, Any]:
        rng = self.rng
        s: dict[str, Any] = {}
        for key in ("cpu_percent", "gpu_util_percent"):
            if rng.random() < 0.7:
                s[key] = self.weird_float()
        for key in ("ram_used_bytes", "ram_total_bytes", "vram_allocated_bytes",
                    "vram_total_bytes"):
            if rng.random() < 0.5:
                s[key] = rng.choice((0, 1, 2**40, 2**63 - 1, 2**64 - 1))
        s["gpus"] = [{"device_index": rng.randrange(8), "name": self.text(rng.randrange(20)),
                      "util_percent": self.weird_float(), "power_w": self.weird_float(),
                      "temperature_c": self.weird_float()}
                     for _ in range(rng.randrange(3))]
        return s

    def valid_dict(self) -> dict[str, Any]:
        """A valid frame for a hostile run (registered in the preamble with world 4)."""
        rng = self.rng
        run, rank = self.run(), self.rank()
        kind = rng.choice(("register", "svg", "metadata", "hardware", "resources", "metrics",
                           "metrics", "metrics", "finish"))
        d: dict[str, Any] = {"type": kind, "run": run, "rank": rank}
        if kind == "register":
            d.update(world_size=HOSTILE_WORLD, host=self.text(rng.randrange(1, 30)),
                     local_rank=rng.randrange(4), port=rng.randrange(65536),
                     total_epochs=rng.randrange(100), pid=rng.randrange(2**31))
            if rng.random() < 0.5:  # the run's label (7.5): any text up to its bound
                d["label"] = rng.choice((self.text(rng.randrange(0, 40)), "",
                                         "<img src=x onerror=alert(1)>",
                                         "\u202e" + "\u4e2d" * (protocol.MAX_LABEL - 1),
                                         self.text(protocol.MAX_LABEL)))
        elif kind == "svg":
            d.update(svg=f"<svg xmlns='http://www.w3.org/2000/svg'><script>alert({rng.random()})"
                         "</script></svg>", label=self.text(10), hash=self.text(8))
        elif kind == "metadata":
            d.update(json=f'{{"lr": {rng.random()}, "s": "{rng.randrange(10**6)}", "x": [1, null]}}')
        elif kind == "hardware":
            d.update(summary=self.text(rng.randrange(0, 60)) + " | " + self.text(10))
        elif kind == "resources":
            d.update(sample=self.sample())
        elif kind == "metrics":
            # mostly low epochs, so all 4 ranks meet and weird values reach the aggregation
            d.update(epoch=self.epoch(), avg_loss=self.weird_float(),
                     batches=rng.randrange(100), samples=rng.randrange(10**6),
                     epoch_ms=self.weird_float(), share_complete_ms=self.weird_float(),
                     scalars={self.text(5): (self.weird_float(), rng.randrange(5))
                              for _ in range(rng.randrange(4))},
                     resources=self.sample() if rng.random() < 0.5 else None)
        else:
            d.update(status=rng.choice(("ok", "error")))
        if rng.random() < 0.1:
            d["unknown_extra_key"] = [self.weird_float(), {"nested": self.text(5)}]
        return d

    # -- the generators --------------------------------------------------------------
    def valid_nonfinite(self) -> Msg:
        d = self.valid_dict()
        return Msg(_enc.encode(d), _accepted(d), "valid_nonfinite")

    def garbage(self) -> Msg:
        body = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(0, 64)))
        return Msg(b"\xc1" + body, one("decode"), "garbage")  # 0xc1: never used in MessagePack

    def random_bytes(self) -> Msg:
        body = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(0, 128)))
        return Msg(body, frozenset(("decode", "schema")), "random_bytes")

    def truncated(self) -> Msg:
        raw = _enc.encode(self.valid_dict())
        return Msg(raw[: self.rng.randrange(len(raw))], one("decode"), "truncated")

    def unknown_tag(self) -> Msg:
        d = self.valid_dict()
        d["type"] = self.rng.choice(("bogus", "", "REGISTER", "metrics ", "x" * 300))
        return Msg(_enc.encode(d), one("schema"), "unknown_tag")

    def wrong_type(self) -> Msg:
        rng = self.rng
        d = self.valid_dict()
        key = rng.choice(("run", "rank", "type", "missing_run", "missing_rank", "bad_run_id",
                          "negative_rank", "huge_rank", "nonfinite_rank", "array", "scalar"))
        if key in ("run", "rank", "type"):
            d[key] = rng.choice(([1, 2], {"a": 1}, None, 1.5, True, b"\x00bytes") if key != "rank"
                                else ("0", [0], {"r": 0}, None, 1.5, True))
        elif key == "missing_run":
            del d["run"]
        elif key == "missing_rank":
            del d["rank"]
        elif key == "bad_run_id":
            d["run"] = rng.choice(("", "a b", "../../etc/passwd", "x" * 129, "run!", "r\x00",
                                   "\u00e9t\u00e9", "<script>", "r1\n", ".", "..", "..."))
        elif key == "negative_rank":
            d["rank"] = -rng.randrange(1, 2**40)
        elif key == "huge_rank":
            d["rank"] = rng.choice((65536, 2**31, 2**63 - 1))
        elif key == "nonfinite_rank":
            d["rank"] = rng.choice(_NONFINITE)
        elif key == "array":
            return Msg(_enc.encode(list(d.values())), one("schema"), "wrong_type")
        else:
            return Msg(_enc.encode(rng.choice((0, "frame", 1.5, None, True))), one("schema"),
                       "wrong_type")
        return Msg(_enc.encode(d), one("schema"), "wrong_type")

    def huge_length(self) -> Msg:
        """MessagePack headers announcing far more data than follows."""
        rng = self.rng
        choice = rng.randrange(4)
        tail = bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
        if choice == 0:   # str32 of 4 GiB at top level
            return Msg(b"\xdb\xff\xff\xff\xff" + tail, one("decode"), "huge_length")
        if choice == 1:   # a frame whose svg claims 4 GiB
            prefix = _enc.encode({"type": "svg", "run": self.run(), "rank": 0})
            head = bytes([prefix[0] + 1]) + prefix[1:]  # one more map entry
            return Msg(head + _enc.encode("svg") + b"\xdb\xff\xff\xff\xff" + tail,
                       one("decode"), "huge_length")
        if choice == 2:   # map32 claiming 4 billion entries
            return Msg(b"\xdf\xff\xff\xff\xff" + _enc.encode("type") + tail,
                       frozenset(("decode", "schema")), "huge_length")
        # a bin32 of 4 GiB inside an ignored extra key of a valid frame
        prefix = _enc.encode(self.valid_dict())
        head = bytes([prefix[0] + 1]) + prefix[1:] if prefix[0] < 0x8F else None
        if head is None:
            return Msg(b"\xc6\xff\xff\xff\xff" + tail, one("decode"), "huge_length")
        return Msg(head + _enc.encode("zz") + b"\xc6\xff\xff\xff\xff" + tail, one("decode"),
                   "huge_length")

    def deep_nesting(self) -> Msg:
        rng = self.rng
        depth = rng.choice((50, 500, 5000, 100_000))
        where = rng.randrange(3)
        if where == 0:   # nested arrays at top level: not a map
            return Msg(b"\x91" * depth + b"\x00", one("schema"), "deep_nesting")
        if where == 1:   # inside an ignored extra key of a valid frame
            d = self.valid_dict()
            d.pop("unknown_extra_key", None)
            raw = _enc.encode(d)
            if raw[0] >= 0x8F:
                return Msg(b"\x91" * depth + b"\x00", one("schema"), "deep_nesting")
            raw = bytes([raw[0] + 1]) + raw[1:] + _enc.encode("deep") + b"\x91" * depth + b"\x00"
            # shallow enough to skip: accepted; too deep for the decoder: decode
            return Msg(raw, _accepted(d) | {"decode"}, "deep_nesting")
        # in the metadata JSON of a hostile run
        text = "[" * depth + "]" * depth
        d = {"type": "metadata", "run": self.run(), "rank": self.rank(), "json": text}
        return Msg(_enc.encode(d), frozenset(("accept", "bad_metadata_json")), "deep_nesting")

    def out_of_range(self) -> Msg:
        """Ranks the schema allows but the run does not; registers that disagree."""
        rng = self.rng
        run = rng.choice(HOSTILE_RUNS + [CHECK_RUN])
        world = CHECK_WORLD if run == CHECK_RUN else HOSTILE_WORLD
        if rng.random() < 0.2:
            run = rng.choice(HOSTILE_RUNS + [CHECK_STEPS_RUN])
            world = CHECK_STEPS_WORLD if run == CHECK_STEPS_RUN else HOSTILE_WORLD
            d = self.steps_dict(run, rng.randrange(world, 65536), n=rng.randrange(1, 5))
            return Msg(_enc.encode(d), one("rank_out_of_range"), "out_of_range")
        if rng.random() < 0.5:
            d = {"type": "metrics", "run": run, "rank": rng.randrange(world, 65536), "epoch": 0,
                 "avg_loss": 1.0}
            return Msg(_enc.encode(d), one("rank_out_of_range"), "out_of_range")
        d = {"type": "register", "run": run, "rank": 0,
             "world_size": rng.choice([w for w in (1, 2, 5, 7, 65536) if w != world]),
             "host": "liar"}
        return Msg(_enc.encode(d), one("world_size_mismatch"), "out_of_range")

    def bad_metadata(self) -> Msg:
        run = self.rng.choice(HOSTILE_RUNS + [CHECK_RUN, CHECK_STEPS_RUN])
        text = self.rng.choice(("{", "{not json", "[1,]", "NaN?", "", "\"unterminated", "{}{}",
                                "\"\\udc00\"", "{\"path\": \"/x\\ud800y\"}", "[\"\\ude00\\ud83d\"]"))
        d = {"type": "metadata", "run": run, "rank": 0, "json": text}
        return Msg(_enc.encode(d), one("bad_metadata_json"), "bad_metadata")

    def over_limit(self) -> Msg:
        """One field just over a PROTOCOL 2 limit (small ones; the MiB ones when ``big``)."""
        rng = self.rng
        run, rank = self.run(), self.rank()
        small = [
            ({"type": "register", "run": run, "rank": rank, "world_size": HOSTILE_WORLD,
              "host": "h" * 257}, "schema"),
            ({"type": "svg", "run": run, "rank": rank, "svg": "<svg/>", "label": "l" * 257},
             "schema"),
            ({"type": "svg", "run": run, "rank": rank, "svg": "<svg/>", "hash": "h" * 257},
             "schema"),
            ({"type": "hardware", "run": run, "rank": rank, "summary": "s" * 4097}, "schema"),
            ({"type": "metrics", "run": run, "rank": rank, "epoch": 0, "avg_loss": 1.0,
              "scalars": {f"s{i}": [1.0, 1] for i in range(257)}}, "schema"),
            ({"type": "metrics", "run": run, "rank": rank, "epoch": 0, "avg_loss": 1.0,
              "scalars": {"n" * 129: [1.0, 1]}}, "schema"),
            ({"type": "resources", "run": run, "rank": rank,
              "sample": {"gpus": [{"device_index": i, "name": "g"} for i in range(65)]}},
             "schema"),
            ({"type": "register", "run": run, "rank": rank, "world_size": 65537, "host": "h"},
             "schema"),
            ({"type": "register", "run": run, "rank": rank, "world_size": 0, "host": "h"},
             "schema"),
            ({"type": "register", "run": run, "rank": rank, "world_size": HOSTILE_WORLD,
              "host": "h", "port": rng.choice((65536, -1))}, "schema"),
            ({"type": "register", "run": run, "rank": rank, "world_size": HOSTILE_WORLD,
              "host": "h", "label": rng.choice(("l", "\u4e2d")) * (protocol.MAX_LABEL + 1)},
             "schema"),
            ({"type": "register", "run": run, "rank": rank, "world_size": HOSTILE_WORLD,
              "host": "h", "label": rng.choice((None, 1, ["l"], {"l": 1}))}, "schema"),
        ]
        if self.big and rng.random() < 0.05:
            big = [
                ({"type": "svg", "run": run, "rank": rank, "svg": "x" * (2 * MiB + 1)}, "schema"),
                ({"type": "svg", "run": run, "rank": rank, "svg": "\u00e9" * (MiB + 1)}, "limit"),
                ({"type": "metadata", "run": run, "rank": rank, "json": "\"" + "\u00e9" *
                  (MiB // 2 + 1) + "\""}, "limit"),
                ({"type": "metadata", "run": run, "rank": rank, "json": "1" * (MiB + 1)},
                 "schema"),
            ]
            d, reason = rng.choice(big)
        else:
            d, reason = rng.choice(small)
        return Msg(_enc.encode(d), one(reason), "over_limit")

    def oversize(self) -> Msg:
        n = protocol.MAX_FRAME_BYTES + 1 + self.rng.randrange(1024)
        return Msg(b"\x00" * n, one("oversize"), "oversize")

    def new_run(self) -> Msg:
        """A valid frame for a brand-new run id. The harness runs the broker with a run cap
        above their number (the cap itself is tested in test_bounds.py): evicting the check
        run would make its records unverifiable."""
        self.new_runs += 1
        d = {"type": "register", "run": f"{NEW_RUN_PREFIX}{self.new_runs}", "rank": 0,
             "world_size": 2, "host": "h"}
        return Msg(_enc.encode(d), one("accept"), "new_run")


#: (generator name, weight). ``oversize`` is rare: each is 4 MiB on the wire.
WEIGHTS: list[tuple[str, float]] = [
    ("valid_nonfinite", 30), ("garbage", 8), ("random_bytes", 8), ("truncated", 10),
    ("unknown_tag", 5), ("wrong_type", 12), ("huge_length", 5), ("deep_nesting", 3),
    ("out_of_range", 6), ("bad_metadata", 3), ("over_limit", 6), ("new_run", 4),
    ("valid_steps", 8), ("bad_steps", 8), ("oversize", 0.02), ("step_names", 0.5),
    ("valid_stacks", 4), ("bad_stacks", 4), ("valid_collectives", 3), ("bad_collectives", 3),
]


def generate(n: int, seed: int, *, big: bool = True) -> tuple[list[Msg], int]:
    """``n`` messages (preamble, the check run, hostile traffic interleaved) and the number
    of epochs of :data:`CHECK_RUN`. Deterministic for a seed."""
    rng = random.Random(seed)
    hostile = _Hostile(rng, big)
    preamble = [Msg(_enc.encode(protocol.Register(run=run, rank=0, world_size=HOSTILE_WORLD,
                                                  host="h")), one("accept"), "preamble")
                for run in HOSTILE_RUNS]
    epochs = max(2, (n // 10) // CHECK_WORLD)
    blocks = max(2, (n // 40) // CHECK_STEPS_WORLD)
    preamble += _check_registers(epochs) + _check_steps_registers()
    check = _merge(_check_script(epochs), _check_steps_script(blocks), rng)
    if n < len(preamble) + len(check):
        raise ValueError(f"need at least {len(preamble) + len(check)} messages")
    names = [name for name, _ in WEIGHTS]
    weights = [w for _, w in WEIGHTS]
    out = list(preamble)
    left_check, left_total = len(check), n - len(preamble)
    ci = 0
    while left_total:
        if left_check and rng.random() < left_check / left_total:
            out.append(check[ci])
            ci += 1
            left_check -= 1
        else:
            out.append(getattr(hostile, rng.choices(names, weights)[0])())
        left_total -= 1
    return out, epochs


def _merge(a: list[Msg], b: list[Msg], rng: random.Random) -> list[Msg]:
    """``a`` and ``b`` interleaved at random, each in its own order."""
    out: list[Msg] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if j == len(b) or (i < len(a) and rng.random() < (len(a) - i) / (len(a) - i + len(b) - j)):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out

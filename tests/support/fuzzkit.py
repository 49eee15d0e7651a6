"""What the ingest fuzz's frame-kind mixins (:mod:`tests.support.fuzzsteps`,
:mod:`tests.support.fuzzstacks`, :mod:`tests.support.fuzzcollectives`) share: the generator
state they read from the fuzz's ``_Hostile`` (:mod:`tests.support.fuzzgen`, which imports
them, so they are handed ``_msg`` rather than importing its ``Msg``), a dump's common head,
the unknown key a valid frame may carry, and the encoding of a frame with its outcome."""
from __future__ import annotations

import random
from typing import Any, Callable

import msgspec

from rank_agent import protocol

__all__ = ["FuzzKit"]

_enc = msgspec.msgpack.Encoder()


class FuzzKit:
    """The base of the fuzz's frame-kind mixins (module docstring)."""

    rng: random.Random
    text: Callable[[int], str]
    run: Callable[[], str]
    rank: Callable[[], int]
    weird_float: Callable[[], float]
    _msg: Callable[[bytes, str, str], Any]

    def _frame(self, d: Any, outcome: str, kind: str) -> Any:
        """``d`` encoded as the wire's MessagePack, with the outcome it must have."""
        return self._msg(_enc.encode(d), outcome, kind)

    def _dump_head(self, kind: str, run: str, rank: int) -> dict[str, Any]:
        """The fields a ``stacks`` and a ``collectives`` frame share: a reason, when it was
        taken (now and then a weird float) and, for a request's answer, its id."""
        rng = self.rng
        reason = rng.choice(("stall", "request"))
        d: dict[str, Any] = {"type": kind, "run": run, "rank": rank, "reason": reason,
                             "taken_at": self.weird_float() if rng.random() < 0.2 else 1.7e9}
        if reason == "request" or rng.random() < 0.1:
            d["request_id"] = self.text(rng.randrange(0, protocol.MAX_REQUEST_ID + 1))
        return d

    def _maybe_extra_key(self, d: dict[str, Any]) -> dict[str, Any]:
        """``d``, now and then with a key the schema does not know (a valid frame still)."""
        if self.rng.random() < 0.05:
            d["unknown_extra_key"] = {"x": [self.weird_float()]}
        return d

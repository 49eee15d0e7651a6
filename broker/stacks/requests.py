"""Which requests for dumps the broker forwards to a run's ranks (PROTOCOL.md section 2.5).

A request makes every rank it names stop and walk its threads (or sample them for seconds):
it costs the training job time. The web answers ``POST /stacks`` with a token, ``--read-only``
and its 429, but the broker is what relays the request to the ranks, and the snapshot socket
it arrives on is reachable by more than the web (issue 32 finding 1: a flood of 116,600
requests from a peer of that socket slowed a training loop's step 12.8 -> 22.9 ms and wrote
126,501 log lines). So the broker judges each request itself, here:

* **who** (under CURVE): only a client whose public key is in the web keys
  (``--curve-web-authorized``) may ask; a rank's key may connect to the same socket (it reads
  the feed) but not make other ranks dump. Without CURVE every peer of the snapshot socket is
  trusted as a web (it is on loopback by default; SECURITY.md);
* **what run**: one the broker holds (a request for any other would reach no one, and
  keeping a clock per invented run name would let a flood grow memory);
* **how often**: at most one request a run per :data:`MIN_INTERVAL_S` (the rule is
  :class:`~broker.stacks.gate.RunGate`, the web's 429 too). A request identical to
  the last one forwarded (same kind, ranks, rate and length) within that second is
  ``coalesced`` (the answers to the first are on their way); a different one is
  ``rate_limited``. Both are refusals, counted like the others.

Pure: the caller passes ``now`` and the peer's key; no sockets, no logging.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Optional, Tuple

from broker.stacks.gate import MIN_INTERVAL_S, RunGate
from rank_agent.controlwire import ControlRequest

__all__ = ["MIN_INTERVAL_S", "REFUSALS", "ForwardGate"]

#: Why a request was not forwarded (the keys of :attr:`ForwardGate.refused`).
REFUSALS = ("malformed", "unauthorized", "unknown_run", "rate_limited", "coalesced")
_Shape = Tuple[str, Optional[Tuple[int, ...]], int, float]


class ForwardGate:
    """The broker's rules for relaying a request (module docstring) and their counters.

    ``web_keys``: the z85 public keys allowed to ask (CURVE), or None when the broker runs
    without CURVE (then the snapshot socket's peers are the webs)."""

    def __init__(self, web_keys: Optional[FrozenSet[str]] = None,
                 runs: Optional[RunGate] = None) -> None:
        self.web_keys = web_keys
        #: requests forwarded to ranks since start
        self.forwarded = 0
        #: reason -> requests refused since start
        self.refused: Dict[str, int] = dict.fromkeys(REFUSALS, 0)
        #: when each run was last forwarded to, and what was asked (the web's 429 is the
        #: same rule: :mod:`broker.stacks.gate`)
        self.runs = RunGate() if runs is None else runs

    def refuse(self, reason: str) -> str:
        """Count a refusal; returns ``reason``."""
        self.refused[reason] += 1
        return reason

    def admit(self, req: ControlRequest, user_id: Optional[str], known: bool,
              now: float) -> Optional[str]:
        """None when ``req`` may be forwarded now (and it is counted as forwarded), else the
        reason it is refused (counted). ``user_id``: the peer's z85 key under CURVE;
        ``known``: whether the broker holds ``req.run``; ``now``: monotonic seconds."""
        if self.web_keys is not None and user_id not in self.web_keys:
            return self.refuse("unauthorized")
        if not known:
            return self.refuse("unknown_run")
        shape: _Shape = (req.kind, None if req.ranks is None else tuple(req.ranks), req.hz,
                         req.seconds)
        last = self.runs.blocking(req.run, now)
        if last is not None:
            return self.refuse("coalesced" if last == shape else "rate_limited")
        self.runs.let_through(req.run, now, shape)
        self.forwarded += 1
        return None

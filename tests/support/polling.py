"""Poll-with-a-deadline, the one way tests (and benchmarks) wait: never a sleep as
synchronisation."""
from __future__ import annotations

import http.client
import time
from typing import Callable, Optional, Tuple, Type, TypeVar

T = TypeVar("T")

#: What a poll treats as "not yet" by default: a server not listening yet (OSError), a
#: half-written or not-yet-complete answer (HTTPException, ValueError from a JSON parse,
#: KeyError from a field not there yet).
NOT_YET: Tuple[Type[BaseException], ...] = (OSError, http.client.HTTPException, ValueError,
                                            KeyError)


def wait_for(predicate: Callable[[], Optional[T]], timeout: float = 15.0,
             what: str = "condition", *, interval: float = 0.05,
             retry_on: Tuple[Type[BaseException], ...] = NOT_YET) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail
    (AssertionError) after ``timeout`` seconds. Exceptions listed in ``retry_on`` count as
    "not yet" and the last one is named on failure; any other exception fails at once
    (``retry_on=()`` makes every exception fail at once).

    Polls every ``interval`` seconds (50 ms: the cadence every suite was written against;
    polling faster only finds the tests that check a condition before its time, such as a
    rank metric that the broker publishes up to a second after the record)."""
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            value, last_exc = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                                 + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)

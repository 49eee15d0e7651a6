"""Poll-with-a-deadline, the one way tests wait (never a sleep as synchronisation)."""
from __future__ import annotations

import time
from typing import Callable, Optional, Tuple, Type, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], Optional[T]], timeout: float = 10.0,
             what: str = "condition", *, interval: float = 0.05,
             retry_on: Tuple[Type[BaseException], ...] = ()) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail the test
    (AssertionError) after ``timeout`` seconds. Exceptions listed in ``retry_on`` (e.g. a
    server not listening yet) count as "not yet" and the last one is named on failure;
    any other exception fails at once."""
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

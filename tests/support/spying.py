"""A spy for the tests that count what code calls (not what a stand-in returns): the real
function still runs."""
from __future__ import annotations

from typing import Any

import pytest


def spy(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple[Any, ...]]:
    """Wrap ``owner.name`` (a module's function, or a class's method: then the instance is
    the first argument) so that each call's positional arguments are recorded, in order,
    and the call goes through unchanged; returns the list they are recorded in."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls

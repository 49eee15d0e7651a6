"""What rankboard calls "a number" in text: ASCII digits, and nothing else.

Why one definition: ``str.isdigit()`` is true for ``"²"`` and ``"٣"``, and ``int()`` takes
``"٣"``, ``" 7 "`` and ``"1_0"`` but not ``"²"``, so a check written with one and a
conversion written with the other disagree on some strings. A collectives group id ``"²"``
passed the check and failed the conversion inside the broker's verdict, and every later
frame of that run failed with it (issue 38). Every place that reads a number out of text a
peer, a user or the environment wrote asks here.

Pure and tiny, in the bottom layer, so the agent, the broker, the web and the command line
share it.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["is_ascii_digits", "ascii_int"]


def is_ascii_digits(text: str) -> bool:
    """True when ``text`` is one or more of ``0``-``9`` and nothing else."""
    return text.isascii() and text.isdigit()


def ascii_int(text: str, max_digits: Optional[int] = None) -> Optional[int]:
    """``int(text)`` when ``text`` is ASCII digits (at most ``max_digits`` of them, when
    given), else None: never an exception, never a number ``int()`` alone would find in a
    sign, blanks, underscores or another script's digits."""
    if not (text.isascii() and text.isdigit()):
        return None
    if max_digits is not None and len(text) > max_digits:
        return None
    return int(text)

"""What a user's values become on the wire: strings clamped to their limit, JSON-like objects
made strict JSON (no NaN or Infinity), ``log_epoch`` scalars as ``{name: (sum, count)}``.
Pure functions, apart from the agent's rate-limited ``warn`` they are handed."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Tuple

from .protocol import MAX_SCALAR_NAME, MAX_SCALARS

__all__ = ["clamp", "finite_or_none", "wire_scalars"]


def clamp(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= limit else text[:limit]


def finite_or_none(obj: Any) -> Any:
    """A copy of JSON-like ``obj`` with NaN/Infinity replaced by ``None`` (strict JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def wire_scalars(scalars: Mapping[Any, Any], warn: Callable[..., object]) -> Dict[str, Tuple[float, int]]:
    """``log_epoch``'s scalars as the wire wants them: ``{name: (sum, count)}``, names
    clamped to 128 characters, at most 256 entries. Raises for a bad value (the caller
    drops the frame)."""
    sc: Dict[str, Tuple[float, int]] = {}
    capped = type(scalars) is not dict or len(scalars) > MAX_SCALARS  # else it cannot bite
    for name, value in scalars.items():
        if capped and len(sc) >= MAX_SCALARS:
            warn("scalars", "rankboard: more than %d scalars; the rest are not sent", MAX_SCALARS)
            break
        kind = type(value)
        if kind is float:
            pair: Tuple[float, int] = (value, 1)
        elif kind is tuple or isinstance(value, (tuple, list)):
            total, count = value[0], value[1]
            if type(total) is not float:
                total = float(total)
            if type(count) is not int:
                count = int(count)
            if count < 0:
                raise ValueError(f"scalar {name!r} has a negative count")
            pair = (total, count)
        else:
            pair = (float(value), 1)
        if type(name) is not str:
            name = str(name)
        if len(name) > MAX_SCALAR_NAME:
            name = name[:MAX_SCALAR_NAME]
        sc[name] = pair
    return sc

"""Buffered ``log_step`` points -> ``steps`` frames the broker accepts (PROTOCOL.md 2, 5).

Pure (no socket, no thread, no clock): the agent's flusher thread calls :func:`step_frames`
with the points it took from the buffer, so every rule (merging a repeated step, a step
going back, the 1,024-point and 64-name limits, ``[]`` for samples/tokens not sent) is a unit
test. Imports only the wire schema.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from .protocol import MAX_STEP_METRIC_NAME, MAX_STEP_METRICS, MAX_STEP_POINTS, Steps

__all__ = ["StepPoint", "step_frames", "flush_interval", "MAX_RUN_STEPS_FRAMES_PER_S"]

#: Most ``steps`` frames a run of any size sends the broker a second (PROTOCOL.md 5, v3):
#: each rank flushes at most every ``world_size / MAX_RUN_STEPS_FRAMES_PER_S`` seconds.
MAX_RUN_STEPS_FRAMES_PER_S = 16384


def flush_interval(step_flush: float, world_size: int) -> float:
    """The flush interval in force (contract v3 section 5): ``max(step_flush, world_size /
    16384)`` seconds, so a run sends at most ~16,384 ``steps`` frames a second whatever its
    size (1,024 ranks: the 0.25 s default holds, 4,096 frames/s; 16,384 ranks: one frame a
    rank a second; 65,536: one every 4 s). A point leaves within about twice that."""
    return max(step_flush, world_size / MAX_RUN_STEPS_FRAMES_PER_S)

#: One ``log_step`` call as buffered: (step, time.time(), step_ms, metrics or None, samples,
#: tokens, data_ms). A tuple, because building it is the cheapest thing the hot path can do.
StepPoint = Tuple[int, float, Optional[float], Optional[Dict[Any, Any]], int, int,
                  Optional[float]]


def _step_metrics(raw: Dict[Any, Any], warn: Callable[..., object]) -> Dict[str, float]:
    """A buffered point's metrics as the wire wants them: ``str`` names clamped to 128
    characters, ``float`` values, at most 64 names (the first ones). ``log_step`` already
    kept only ``int``/``float`` values; an ``int`` too large for a float is skipped here.

    ``raw`` is the agent's own copy (log_step made it), so a dict that is already right (the
    usual case) is returned as it is."""
    if len(raw) <= MAX_STEP_METRICS:
        for name, value in raw.items():
            if (type(value) is not float or type(name) is not str
                    or len(name) > MAX_STEP_METRIC_NAME):
                break
        else:
            return raw
    out: Dict[str, float] = {}
    for name, value in raw.items():
        if type(name) is not str:
            name = str(name)
        if len(name) > MAX_STEP_METRIC_NAME:
            name = name[:MAX_STEP_METRIC_NAME]
        if type(value) is not float:
            try:
                value = float(value)
            except OverflowError:
                warn("step_value", "rankboard: step metric %r does not fit a float; skipped", name)
                continue
        if len(out) >= MAX_STEP_METRICS and name not in out:
            warn("step_names", "rankboard: more than %d step metrics in one point; the rest "
                 "are not sent", MAX_STEP_METRICS)
            continue
        out[name] = value
    return out


def _ignore(*args: Any, **kwargs: Any) -> None:
    pass


def step_frames(run: str, rank: int, points: List[StepPoint], last: StepPoint | None = None,
                warn: Callable[..., object] = _ignore) -> Tuple[List[Steps], StepPoint | None]:
    """Turn buffered ``log_step`` points (in call order) into ``steps`` frames the broker
    accepts: pure, so that every rule below is a unit test.

    * **Repeated step** (consecutive calls with the same step, e.g. one call at the step's
      end and one from a logging hook, or one per gradient-accumulation micro-batch): merged
      into one point. Metrics are united (a later value of a name wins), ``samples`` and
      ``tokens`` add up, ``time``, ``step_ms`` and ``data_ms`` are the first call's (a
      repeat has no ``step_ms`` of its own; its ``data_ms`` counts when the first had none). ``last`` is the last point of the previous flush: when a
      flush starts with its step, the merged point is sent again, and the broker's
      per-(rank, step) last write then holds the merged view rather than only the repeat.
    * **Step going back** (a restart of counting): a new frame starts there, since steps
      are strictly increasing within a frame; the broker drops what is already closed.
    * A frame holds at most 1024 points and at most 64 metric names (the union over its
      points); a frame that would exceed either ends before that point.
    * ``samples``/``tokens`` are ``[]`` (not sent) in a frame where all of them are 0;
      a metric's entry is ``None`` at the points that did not log it.

    Returns ``(frames, new_last)``. It runs in the flusher thread with the GIL held, so the
    common case (increasing steps, the same few names) stays a few C-level passes per point.
    """
    merged: List[StepPoint] = []
    prev_step = last[0] if last is not None else -1
    for step, t, ms, raw, samples, tokens, data in points:
        metrics = _step_metrics(raw, warn) if raw else None
        if step != prev_step:
            merged.append((step, t, ms, metrics, samples, tokens, data))
            prev_step = step
            continue
        if merged:
            cur = merged.pop()
        else:  # repeats the last point of the previous flush: merge and send it again
            assert last is not None
            cur = last
        have = dict(cur[3]) if cur[3] else {}
        for name, value in (metrics or {}).items():
            if name in have or len(have) < MAX_STEP_METRICS:
                have[name] = value
            else:
                warn("step_names", "rankboard: more than %d step metrics in one point; the "
                     "rest are not sent", MAX_STEP_METRICS)
        merged.append((step, cur[1], cur[2] if cur[2] is not None else ms, have or None,
                       cur[4] + samples, cur[5] + tokens, cur[6] if cur[6] is not None else data))
    if not merged:
        return [], last

    frames: List[Steps] = []
    n = len(merged)
    i = 0
    while i < n:
        names: Dict[str, None] = {}  # the frame's metric names, in first-seen order
        prev = -1
        j = i
        stop = min(n, i + MAX_STEP_POINTS)
        while j < stop:
            point = merged[j]
            if point[0] <= prev:
                break
            metrics = point[3]
            if metrics and not metrics.keys() <= names.keys():
                new = [name for name in metrics if name not in names]
                if len(names) + len(new) > MAX_STEP_METRICS and j > i:
                    break
                names.update(dict.fromkeys(new))
            prev = point[0]
            j += 1
        steps, times, step_ms, metric_cols, samples_col, tokens_col, data_col = zip(*merged[i:j])
        i = j
        frames.append(Steps(
            run=run, rank=rank, steps=list(steps), times=list(times), step_ms=list(step_ms),
            samples=list(samples_col) if any(samples_col) else [],
            tokens=list(tokens_col) if any(tokens_col) else [],
            metrics={name: [m.get(name) if m else None for m in metric_cols] for name in names},
            data_ms=list(data_col) if data_col.count(None) != len(data_col) else [],
        ))
    return frames, merged[-1]

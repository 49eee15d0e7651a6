"""The runs the ingest fuzz sends to (:mod:`tests.support.fuzzgen` and its frame-kind mixins
:mod:`tests.support.fuzzsteps`, :mod:`tests.support.fuzzstacks`): the checkable runs whose
outcome is known in advance, the hostile ones, and their world sizes."""
from __future__ import annotations

CHECK_RUN = "fz-check"
CHECK_WORLD = 3
CHECK_STEPS_RUN = "fz-steps"
CHECK_STEPS_WORLD = 3
#: Points per steps frame of the check steps run.
CHECK_STEP_BLOCK = 8
HOSTILE_RUNS = [f"fz-h{i}" for i in range(6)]
HOSTILE_WORLD = 4
NEW_RUN_PREFIX = "fz-n"
#: A run that only collects distinct step metric names, 64 new ones a frame: the first
#: 1,024 are accepted, every frame after that is rejected (``step_metric_names``, v3).
NAMES_RUN = "fz-names"

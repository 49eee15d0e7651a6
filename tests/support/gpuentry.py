"""A healthy GPU as a feed ``ranks`` entry carries it (every v3 health field), for the
``/metrics`` tests and the process serving a big run's ``/metrics``
(:mod:`tests.support.metricsweb`). No side effects on import: metricsweb monkey-patches for
gevent, so what the in-process tests share with it lives here (issue 44: it was copied)."""
from __future__ import annotations

from typing import Any


def health_gpu(index: int, **fields: Any) -> dict[str, Any]:
    """GPU ``index`` busy and healthy; ``fields`` override (``ecc_uncorrected=3``...)."""
    gpu: dict[str, Any] = {
        "device_index": index, "name": "H100", "util_percent": 99.0, "sm_clock_mhz": 1980.0,
        "throttle_reasons": [], "xid_errors": [], "ecc_uncorrected": 0,
        "remapped_rows_pending": False, "remapped_rows_failed": False, "pcie_link_gen": 5,
        "pcie_link_gen_max": 5, "pcie_link_width": 16, "pcie_link_width_max": 16,
        "nvlink_errors": 0}
    gpu.update(fields)
    return gpu

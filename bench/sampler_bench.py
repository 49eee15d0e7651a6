"""sampler_sample_us with the GPU health fields: one ``Sampler.sample()`` on a GPU rank.

There is no GPU on the machines these figures are usually taken on, so the NVML side is a
stand-in module (:class:`CostlyNvml`) answering every call the sampler makes (the four v2
readings and the health reader's six per-sample calls, one of them a field-values call for
seven fields: ECC, two remapped-row flags, four NVLink totals) after **busy-waiting ``call_us``
microseconds**, which stands for the ioctl round trip into the NVIDIA kernel driver that a real
query costs. That cost is an assumption, not a measurement: 10 us by default (NVIDIA does not
document per-query latency; simple NVML getters are one driver ioctl each, commonly a few to a
few tens of microseconds on current drivers, slower on old boards; that the field-values
call for seven fields costs about one getter, not seven, is an assumption too: NVML reports
each field's ``latencyUsec``, ``--real`` on a GPU machine would tell). The details give the
figure with free calls (``python_us``: psutil plus the sampler's own Python) and the number of
NVML calls a sample makes, so the figure can be recomputed for any per-call cost:
``value ~= python_us + nvml_calls_per_sample * call_us``.

``--real`` measures with the installed pynvml against the real driver instead (on a GPU
machine); ``--call-us`` changes the assumed cost. Median over the samples; p99 in the details.

    python bench/sampler_bench.py [--quick] [--call-us 10] [--real]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import percentile, result  # noqa: E402

from rank_agent.sampler import Sampler  # noqa: E402

#: The NVML calls made at start-up only (device lookup, one-off health reads); free here.
_SETUP = {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
          "nvmlDeviceIsMigDeviceHandle", "nvmlDeviceGetIndex", "nvmlDeviceGetName",
          "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth",
          "nvmlDeviceGetNvLinkState", "nvmlEventSetCreate", "nvmlDeviceRegisterEvents",
          "nvmlEventSetFree"}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class NVMLError_Timeout(NVMLError):  # noqa: N801 - pynvml's spelling
    def __init__(self) -> None:
        super().__init__(10)


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(3)


def _spin(us: float) -> None:
    """Busy-wait ``us`` microseconds (a sleep cannot be this short or this exact)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class CostlyNvml:
    """An H100-like device on NVLink that supports every health call; each per-sample call
    costs ``call_us`` of wall time. ``calls`` counts the per-sample calls made."""

    NVMLError = NVMLError
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_NotSupported = NVMLError_NotSupported
    NVML_TEMPERATURE_GPU = 0
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, call_us: float) -> None:
        self.call_us = call_us
        self.calls = 0
        gpu = SimpleNamespace(uuid="GPU-0")
        ok = SimpleNamespace(nvmlReturn=0, valueType=3, value=SimpleNamespace(ullVal=0))  # as pynvml's
        link_state: Callable[..., Any] = self._link_state
        self._answers: dict[str, Callable[..., Any]] = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: 1, "nvmlDeviceGetHandleByIndex": lambda i: gpu,
            "nvmlDeviceIsMigDeviceHandle": lambda h: False, "nvmlDeviceGetIndex": lambda h: 0,
            "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97, memory=40),
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=70 << 30, total=80 << 30),
            "nvmlDeviceGetTemperature": lambda h, s: 71, "nvmlDeviceGetPowerUsage": lambda h: 690_000,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4,
            "nvmlDeviceGetClockInfo": lambda h, c: 1980, "nvmlDeviceGetTotalEccErrors": lambda h, e, c: 0,
            "nvmlDeviceGetRemappedRows": lambda h: (0, 0, 0, 0),
            "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 5, "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16, "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetNvLinkState": link_state,
            "nvmlDeviceGetFieldValues": lambda h, ids: [ok for _ in ids],
            "nvmlEventSetCreate": lambda: "set", "nvmlDeviceRegisterEvents": lambda h, t, s: None,
            "nvmlEventSetWait": self._wait, "nvmlEventSetFree": lambda s: None,
        }

    @staticmethod
    def _link_state(h: Any, link: int) -> int:
        if link >= 18:
            raise NVMLError(2)
        return 1

    @staticmethod
    def _wait(events: Any, timeout_ms: int) -> Any:
        raise NVMLError_Timeout()  # no XID since the previous sample: the usual case

    def __getattr__(self, name: str) -> Any:
        answer = self._answers.get(name)
        if answer is None:
            raise AttributeError(name)
        if name in _SETUP:
            return answer

        def call(*args: Any) -> Any:
            self.calls += 1
            _spin(self.call_us)
            return answer(*args)

        return call


def _time_samples(sampler: Sampler, n: int) -> list[float]:
    sampler.sample()  # the first sample does the one-off reads
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sampler.sample()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def run(quick: bool, call_us: float = 10.0, real: bool = False) -> list[dict[str, Any]]:
    n = 500 if quick else 5000
    if real:
        sampler = Sampler(0)
        try:
            us = _time_samples(sampler, n)
            gpu = sampler.gpu_name
        finally:
            sampler.close()
        return [result("sampler_sample_us", round(statistics.median(us), 2), "us",
                       p99_us=round(percentile(us, 99), 1), gpu=gpu or False, nvml="real", samples=n)]
    free = CostlyNvml(0.0)
    sampler = Sampler(0, cuda_visible_devices=None, nvml=free)
    try:
        python_us = statistics.median(_time_samples(sampler, n))
        per_sample = free.calls / (n + 1)
    finally:
        sampler.close()
    nv = CostlyNvml(call_us)
    sampler = Sampler(0, cuda_visible_devices=None, nvml=nv)
    try:
        us = _time_samples(sampler, n)
        health = sampler.sample().gpus[0]
    finally:
        sampler.close()
    assert health.nvlink_errors == 0 and health.pcie_link_width_max == 16  # the health path ran
    return [result("sampler_sample_us", round(statistics.median(us), 2), "us",
                   p99_us=round(percentile(us, 99), 1), gpu="fake", nvml="fake",
                   call_us=call_us, nvml_calls_per_sample=round(per_sample, 2),
                   python_us=round(python_us, 2), samples=n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="500 samples instead of 5000")
    parser.add_argument("--call-us", type=float, default=10.0, help="assumed cost of one NVML query")
    parser.add_argument("--real", action="store_true", help="the installed pynvml and driver (a GPU machine)")
    parser.add_argument("--details", action="store_true", help="print the details too")
    args = parser.parse_args()
    for line in run(args.quick, args.call_us, args.real):
        extra = line.pop("_extra", {})
        print(json.dumps(line))
        if args.details:
            print(json.dumps(extra), file=sys.stderr)


if __name__ == "__main__":
    main()

"""The demo's simulated GPUs: a stand-in for ``pynvml`` that the real sampler reads.

``rankboard demo`` runs on laptops and CI machines without a GPU, yet the page has GPU panels
(utilisation, VRAM, the GPU health tags, the per-rank picture coloured by health) and GPU
alerts to show. Rather than inventing ``GpuSample`` frames beside the agent, each demo rank
gives its real :class:`rank_agent.sampler.Sampler` a :class:`SimulatedNvml`: the sampler and
its :class:`rank_agent.gpuhealth.GpuHealth` run their real code paths (device lookup, the
XID event set polled with a zero timeout, the clock event reason bits, NVLink field values)
against a device whose readings are scripted by sample number:

* every simulated GPU runs at 88-98 % utilisation, near its power cap (``sw_power_cap``,
  which is normal at full load and raises nothing);
* the **thermal** rank's GPU throttles (``hw_thermal``, SM clock cut, 89 °C) in samples
  :data:`THROTTLE_FROM` to :data:`THROTTLE_TO` - 1, then clears: two consecutive samples
  raise ``gpu_throttle``;
* the **XID** rank's GPU reports XID :data:`XID_CODE` once, in sample :data:`XID_AT`:
  ``gpu_xid``.

A reading costs a few attribute reads and one ``random`` call: the demo's CPU stays small.
Samples are counted by the clock event reason read, which the sampler makes once per
:meth:`~rank_agent.sampler.Sampler.sample` (never for the hardware summary).
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import Any

#: Samples (1-based, as the sampler takes them) in which the thermal GPU throttles.
THROTTLE_FROM = 3
THROTTLE_TO = 11
#: The sample in which the XID GPU reports its XID, and the code (79: the GPU has fallen off
#: the bus, the classic "drain the node" XID).
XID_AT = 4
XID_CODE = 79
NAME = "NVIDIA H100 80GB HBM3 (simulated)"
_GIB = 1024**3
_SW_POWER_CAP = 0x04
_HW_THERMAL = 0x40
_XID_EVENT = 0x08
_TIMEOUT = 10
_NOT_SUPPORTED = 3


class NVMLError(Exception):
    """pynvml's error class shape: ``value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_Timeout(NVMLError):  # noqa: N801 (pynvml's name)
    def __init__(self) -> None:
        super().__init__(_TIMEOUT)


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's name)
    def __init__(self) -> None:
        super().__init__(_NOT_SUPPORTED)


def roles(world_size: int, hosts: int = 1) -> tuple[int, int]:
    """(the rank whose GPU throttles, the rank whose GPU reports an XID) in a run of
    ``world_size`` ranks on ``hosts`` hosts: the last host's second and third ranks, folded
    onto fewer ranks on a small host (one host: ranks 1 and 2).

    Both sit on the last host, where the demo's slow-input rank (the last rank) runs too: one
    bad node, as the cluster view should find it. Spread over two hosts, the throttling GPU
    gave a second host incidents in two runs every round, and the hosts table called both
    hosts suspect (issue 37)."""
    hosts = max(1, min(hosts, world_size))
    per_host = math.ceil(world_size / hosts)
    first = (math.ceil(world_size / per_host) - 1) * per_host  # the last host's first rank
    on_host = world_size - first
    thermal = first + (1 if on_host > 1 else 0)
    xid = first + (2 if on_host > 2 else 0)
    return thermal, xid


class SimulatedNvml:
    """The part of ``pynvml`` the sampler and :class:`~rank_agent.gpuhealth.GpuHealth` use,
    for one simulated GPU at NVML index ``index`` (the rank's local rank)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_NVLINK_MAX_LINKS = 18
    nvmlEventTypeXidCriticalError = _XID_EVENT
    NVMLError = NVMLError
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(self, index: int, *, throttles: bool = False, xid: bool = False,
                 seed: str = "") -> None:
        self.index = index
        self.throttles = throttles
        self.xid = xid
        #: samples taken so far (clock event reason reads)
        self.samples = 0
        self._xid_pending = False
        self._rng = random.Random(seed)

    def _hot(self, ahead: int = 0) -> bool:
        """Whether sample ``self.samples + ahead`` throttles (the sampler reads load,
        temperature and power before the clock event reasons that count the sample, so those
        reads pass ``ahead=1``)."""
        return self.throttles and THROTTLE_FROM <= self.samples + ahead < THROTTLE_TO

    # -- lifecycle and lookup ------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names, here and below)
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return self.index + 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:  # noqa: N802
        return False

    def nvmlDeviceGetIndex(self, handle: Any) -> int:  # noqa: N802
        return int(handle)

    def nvmlDeviceGetName(self, handle: Any) -> str:  # noqa: N802
        return NAME

    # -- load ------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:  # noqa: N802
        util = self._rng.uniform(88.0, 98.0) * (0.8 if self._hot(1) else 1.0)
        return SimpleNamespace(gpu=round(util), memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:  # noqa: N802
        used = int((52 + 2 * self.index + self._rng.uniform(0.0, 1.5)) * _GIB)
        return SimpleNamespace(used=used, total=80 * _GIB, free=80 * _GIB - used)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:  # noqa: N802
        return 89 if self._hot(1) else 62 + self.index

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:  # noqa: N802
        return int(self._rng.uniform(610.0, 695.0) * 1000)  # mW

    # -- health ------------------------------------------------------------------------------
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:  # noqa: N802
        self.samples += 1
        if self.xid and self.samples == XID_AT:
            self._xid_pending = True
        return _SW_POWER_CAP | (_HW_THERMAL if self._hot() else 0)

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:  # noqa: N802
        return 1410 if self._hot() else 1980

    def nvmlEventSetCreate(self) -> object:  # noqa: N802
        return object()

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, events: Any) -> None:  # noqa: N802
        pass

    def nvmlEventSetWait(self, events: Any, timeout_ms: int) -> Any:  # noqa: N802
        if self._xid_pending:
            self._xid_pending = False
            return SimpleNamespace(eventType=_XID_EVENT, eventData=XID_CODE, device=self.index)
        raise NVMLError_Timeout()

    def nvmlEventSetFree(self, events: Any) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:  # noqa: N802
        return 0

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:  # noqa: N802
        return (0, 0, 0, 0)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:  # noqa: N802
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:  # noqa: N802
        return 16

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:  # noqa: N802
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:  # noqa: N802
        return 16

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetFieldValues(self, handle: Any, fields: list[int]) -> list[Any]:  # noqa: N802
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=0)) for _ in fields]


def simulated_sampler(rank: int, world_size: int, local_rank: int, seed: str = "",
                      hosts: int = 1) -> Any:
    """The real :class:`~rank_agent.sampler.Sampler` (host CPU and RAM as they are) reading a
    :class:`SimulatedNvml` GPU scripted for ``rank``'s role in the run."""
    from rank_agent.sampler import Sampler

    thermal, xid = roles(world_size, hosts)
    nvml = SimulatedNvml(local_rank, throttles=rank == thermal, xid=rank == xid, seed=seed)
    return Sampler(local_rank, cuda_visible_devices=None, nvml=nvml)


def use_simulated_gpu(agent: Any, world_size: int, seed: str = "", hosts: int = 1) -> None:
    """Make ``agent`` sample a simulated GPU: call before ``set_hardware``/``start_sampling``.

    RankAgent creates its sampler on first need and has no public way to pass one; the
    demo is its own package's code, so it sets the agent's sampler slot directly."""
    agent._get_sampling().sampler = simulated_sampler(agent.rank, world_size, agent.local_rank,
                                                      seed, hosts)

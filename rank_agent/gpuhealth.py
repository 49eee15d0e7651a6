"""GPU health reads through NVML: the v3 health fields of a ``GpuSample`` (PROTOCOL.md section 2).

Most training interruptions are hardware, and many announce themselves first as clock
throttling, XID errors, uncorrected ECC errors, remapped memory rows, a PCIe link that trained
down or NVLink errors. :class:`GpuHealth` reads those for one device handle and writes them
into a :class:`~rank_agent.protocol.GpuSample` the sampler has already filled.

It is a guest in a training process, like the sampler that owns it:

* it talks to the driver through NVML only (never a CUDA context) and runs on the sampler's
  thread, never the training thread;
* **a call that fails is given up, once**: the device does not support it (consumer boards
  have no ECC, PCIe boards no NVLink), the installed ``pynvml`` lacks it, or it raised. The
  field stays ``None`` (or ``[]``) from then on, the call is never made again and the reason is
  logged once at DEBUG (not supported, missing) or INFO (anything else): at one sample every
  two seconds, a retried failing call would be pure cost and a log line per sample noise;
* XID errors come from an NVML event set registered for critical XID events and polled with a
  **zero** timeout (``nvmlEventSetWait(set, 0)``): it returns at once with the events queued
  since the previous sample, or with ``NVML_ERROR_TIMEOUT`` when there are none. It never waits;
* values that cannot change while the process lives (the PCIe link's maximum generation and
  width for this device in this slot, which NVLink links are active) are read once.

Per sample this costs, on a device that supports everything, 6 NVML calls: clock event
reasons, SM clock, one event poll, PCIe generation, PCIe width and one
``nvmlDeviceGetFieldValues`` for the uncorrected ECC count, the two remapped-row flags and the
four NVLink error totals (summed over every link by the driver). Where the field-values call
fails, or one of its fields reports an error, that group of fields goes back to its own call
(``nvmlDeviceGetTotalEccErrors``, ``nvmlDeviceGetRemappedRows``, the per-link NVLink counters:
four calls a link) from then on, and those calls give up as above.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from .protocol import MAX_XID_ERRORS, GpuSample, ThrottleReason

log = logging.getLogger(__name__)

#: NVML's clock event reason bits (``nvmlClocksEventReason*``, the same bits as the older
#: ``nvmlClocksThrottleReason*``; part of NVML's ABI) -> the contract's names. Idle, application
#: clocks, sync boost and display clock are not health news and are left out.
REASON_BITS: tuple[tuple[int, ThrottleReason], ...] = (
    (0x04, "sw_power_cap"),
    (0x08, "hw_slowdown"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
)
#: ``nvmlEventTypeXidCriticalError``.
XID_EVENT = 0x08
#: NVML constants the reads use (``NVML_CLOCK_SM``, ``NVML_MEMORY_ERROR_TYPE_UNCORRECTED``,
#: ``NVML_VOLATILE_ECC``, ``NVML_FEATURE_ENABLED``, ``NVML_ERROR_TIMEOUT``,
#: ``NVML_ERROR_NOT_SUPPORTED``, ``NVML_ERROR_FUNCTION_NOT_FOUND``).
CLOCK_SM = 1
ECC_UNCORRECTED = 1
ECC_VOLATILE = 0
FEATURE_ENABLED = 1
ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
ERROR_FUNCTION_NOT_FOUND = 13
#: ``NVML_FI_DEV_NVLINK_{CRC_FLIT,CRC_DATA,REPLAY,RECOVERY}_ERROR_COUNT_TOTAL``: the driver's
#: totals over every link.
NVLINK_TOTAL_FIELDS = (38, 45, 52, 59)
#: The groups of fields read in one ``nvmlDeviceGetFieldValues`` call a sample (NVML's field ids
#: are its ABI): ``NVML_FI_DEV_ECC_DBE_VOL_TOTAL`` (uncorrected volatile, the count
#: ``nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)`` gives), ``NVML_FI_DEV_REMAPPED_PENDING``
#: and ``..._FAILURE`` (``nvmlDeviceGetRemappedRows``'s last two), the NVLink totals. A group whose
#: field reports an error goes back to its own call; NVLink sums the totals that read (a driver
#: may lack one of the four), and goes back only when none did.
FIELD_GROUPS: dict[str, tuple[int, ...]] = {
    "ecc_uncorrected": (4,),
    "remapped_rows": (144, 145),
    "nvlink_errors": NVLINK_TOTAL_FIELDS,
}
#: ``c_nvmlValue_t``'s member for each ``NVML_VALUE_TYPE_*`` (0-6); unknown types read ``ullVal``.
VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
#: ``NVML_NVLINK_ERROR_DL_{REPLAY,RECOVERY,CRC_FLIT,CRC_DATA}`` for the per-link fallback.
NVLINK_COUNTERS = (0, 1, 2, 3)
#: ``NVML_NVLINK_MAX_LINKS`` of current drivers (older pynvml releases say fewer).
NVLINK_MAX_LINKS = 36
#: Most events one poll drains: a storm of identical XIDs must not hold the sampler thread.
MAX_EVENTS_PER_POLL = 1024


def _nvml_code(exc: BaseException) -> int | None:
    """The NVML return code of a pynvml error (``NVMLError.value``), else ``None``."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _pending_failed(rows: Any) -> tuple[bool, bool]:
    """``nvmlDeviceGetRemappedRows``'s (correctable, uncorrectable, pending, failure) -> the
    two flags the contract carries."""
    return bool(rows[2]), bool(rows[3])


def _field_value(v: Any) -> int:
    """One ``c_nvmlFieldValue_t``'s value as an int, read through the member its type names."""
    kind = int(getattr(v, "valueType", 3))
    member = VALUE_MEMBERS[kind] if 0 <= kind < len(VALUE_MEMBERS) else "ullVal"
    value = int(getattr(v.value, member))
    if value < 0:
        raise ValueError(f"field {getattr(v, 'fieldId', '?')}: negative count {value}")
    return value


class GpuHealth:
    """Reads the health fields of one GPU; never raises, never blocks, gives up failing calls.

    ``nvml`` is the ``pynvml`` module (or a stand-in with the same names); ``handle`` the
    device's NVML handle (for a MIG instance, its parent GPU: that is where clocks, ECC,
    PCIe, NVLink and XIDs live). The constructor does no I/O; the event set and the one-off
    reads happen on the first :meth:`fill`. :meth:`close` frees the event set and must run
    before ``nvmlShutdown``.
    """

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nv = nvml
        self._handle = handle
        self._lock = threading.Lock()
        self._off: set[str] = set()  # fields given up: never asked again
        self._started = False
        self._events: Any = None  # the XID event set, once registered
        self._gen_max: int | None = None
        self._width_max: int | None = None
        self._nvlinks: list[int] = []  # active links (per-link fallback)
        #: FIELD_GROUPS still read by the one field-values call (set on the first fill)
        self._by_fields: list[str] = []
        #: XID events beyond what one sample carries (distinct codes over 64, or past the
        #: per-poll drain bound); diagnostics only.
        self.xid_dropped = 0

    # -- calls ----------------------------------------------------------------------------

    def _give_up(self, field: str, exc: BaseException | None) -> None:
        """Remember that ``field`` cannot be read, and say so once."""
        self._off.add(field)
        code = _nvml_code(exc) if exc is not None else ERROR_FUNCTION_NOT_FOUND
        if exc is None or code in (ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND):
            log.debug("GPU health: %s not available on this device/driver; not asked again", field)
        else:
            log.info("GPU health: reading %s failed (%s); not asked again", field, exc)

    def _fn(self, *names: str) -> Callable[..., Any] | None:
        """The first of ``names`` the NVML module has (newer names first)."""
        for name in names:
            fn = getattr(self._nv, name, None)
            if callable(fn):
                return fn
        return None

    def _call(self, field: str, names: tuple[str, ...], *args: Any,
              conv: Callable[[Any], Any] = int) -> Any:
        """One NVML read for ``field`` converted by ``conv``; ``None`` (and the field given up)
        when the call fails or its value does not convert."""
        if field in self._off:
            return None
        fn = self._fn(*names)
        if fn is None:
            self._give_up(field, None)
            return None
        try:
            return conv(fn(self._handle, *args))
        except Exception as exc:  # NVMLError of any kind, or a value that makes no sense
            self._give_up(field, exc)
            return None

    # -- one-off set-up ---------------------------------------------------------------------

    def _start(self) -> None:
        """Register the XID event set and read what cannot change; once, on the first fill."""
        self._started = True
        gen_max = self._call("pcie_link_gen_max", ("nvmlDeviceGetMaxPcieLinkGeneration",))
        width_max = self._call("pcie_link_width_max", ("nvmlDeviceGetMaxPcieLinkWidth",))
        self._gen_max, self._width_max = gen_max, width_max
        self._start_xid()
        self._start_nvlink()
        if self._fn("nvmlDeviceGetFieldValues") is not None:
            self._by_fields = [g for g in FIELD_GROUPS if g not in self._off]

    def _start_xid(self) -> None:
        nv = self._nv
        create = self._fn("nvmlEventSetCreate")
        register = self._fn("nvmlDeviceRegisterEvents")
        if create is None or register is None or self._fn("nvmlEventSetWait") is None:
            self._give_up("xid_errors", None)
            return
        events = None
        try:
            events = create()
            register(self._handle, getattr(nv, "nvmlEventTypeXidCriticalError", XID_EVENT), events)
        except Exception as exc:
            self._give_up("xid_errors", exc)
            self._free(events)
            return
        self._events = events

    def _start_nvlink(self) -> None:
        """Find the active links; with none, the device has no NVLink to report on."""
        state = self._fn("nvmlDeviceGetNvLinkState")
        if state is None:
            self._give_up("nvlink_errors", None)
            return
        links = int(getattr(self._nv, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS))
        last: BaseException | None = None
        for link in range(max(links, 1)):
            try:
                if int(state(self._handle, link)) == FEATURE_ENABLED:
                    self._nvlinks.append(link)
            except Exception as exc:  # past the device's links (or no NVLink at all on link 0)
                last = exc
                break
        if not self._nvlinks:
            self._give_up("nvlink_errors", last)

    def _free(self, events: Any) -> None:
        free = self._fn("nvmlEventSetFree")
        if events is not None and free is not None:
            try:
                free(events)
            except Exception as exc:
                log.debug("GPU health: freeing the event set failed: %s", exc)

    # -- per-sample reads -------------------------------------------------------------------

    def _poll_xids(self) -> list[int]:
        """Distinct XID codes queued since the previous poll, first seen first (≤ 64)."""
        if self._events is None:
            return []
        wait = self._fn("nvmlEventSetWait")
        assert wait is not None  # checked when the set was registered
        timeout_cls = getattr(self._nv, "NVMLError_Timeout", None)
        codes: list[int] = []
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = wait(self._events, 0)  # 0 ms: return at once, never wait
            except Exception as exc:
                if (isinstance(timeout_cls, type) and isinstance(exc, timeout_cls)) or \
                        _nvml_code(exc) == ERROR_TIMEOUT:
                    return codes  # nothing (more) queued: the normal end of a poll
                self._give_up("xid_errors", exc)
                self._free(self._events)
                self._events = None
                return codes
            if not int(getattr(data, "eventType", XID_EVENT)) & XID_EVENT:
                continue
            code = int(data.eventData)
            if code in codes:
                continue
            if len(codes) >= MAX_XID_ERRORS:
                self.xid_dropped += 1
                continue
            codes.append(code)
        self.xid_dropped += 1  # the drain bound was hit: more may be queued for the next poll
        return codes

    def _read_fields(self) -> dict[str, list[int]]:
        """One ``nvmlDeviceGetFieldValues`` call for every group still read that way -> the
        values of the groups it answered. A group it did not answer goes back to its own call
        from now on; a call that fails (or answers nonsense) sends every group back."""
        groups = self._by_fields
        if not groups:
            return {}
        ids = [fid for group in groups for fid in FIELD_GROUPS[group]]
        fn = self._fn("nvmlDeviceGetFieldValues")
        out: dict[str, list[int]] = {}
        try:
            assert fn is not None  # checked when the groups were set
            values = fn(self._handle, ids)
            if len(values) != len(ids):
                raise ValueError(f"{len(values)} values for {len(ids)} fields")
            at = 0
            for group in list(groups):
                part = values[at:at + len(FIELD_GROUPS[group])]
                at += len(part)
                read = [_field_value(v) for v in part if int(v.nvmlReturn) == 0]
                if len(read) == len(part) or (read and group == "nvlink_errors"):
                    out[group] = read
                else:
                    groups.remove(group)
                    log.debug("GPU health: %s not in NVML's field values here; read by its own "
                              "call from now on", group)
        except Exception as exc:  # NVMLError of the call, or values that make no sense
            groups.clear()
            log.debug("GPU health: field values failed (%s); each read by its own call from now on",
                      exc)
            return {}
        return out

    def _nvlink_errors(self) -> int | None:
        """The per-link fallback: four error counters summed over every active link."""
        if "nvlink_errors" in self._off:
            return None
        counter = self._fn("nvmlDeviceGetNvLinkErrorCounter")
        if counter is None:
            self._give_up("nvlink_errors", None)
            return None
        total = 0
        try:
            for link in self._nvlinks:
                for kind in NVLINK_COUNTERS:
                    total += int(counter(self._handle, link, kind))
        except Exception as exc:
            self._give_up("nvlink_errors", exc)
            return None
        return total

    def _read(self, gpu: GpuSample) -> None:
        reasons = self._call("throttle_reasons", ("nvmlDeviceGetCurrentClocksEventReasons",
                                                  "nvmlDeviceGetCurrentClocksThrottleReasons"))
        if reasons is not None:
            gpu.throttle_reasons = [name for bit, name in REASON_BITS if reasons & bit]
        gpu.sm_clock_mhz = self._call("sm_clock_mhz", ("nvmlDeviceGetClockInfo",),
                                      getattr(self._nv, "NVML_CLOCK_SM", CLOCK_SM), conv=float)
        gpu.xid_errors = self._poll_xids()
        fields = self._read_fields()
        ecc = fields.get("ecc_uncorrected")
        gpu.ecc_uncorrected = ecc[0] if ecc is not None else self._call(
            "ecc_uncorrected", ("nvmlDeviceGetTotalEccErrors",),
            getattr(self._nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", ECC_UNCORRECTED),
            getattr(self._nv, "NVML_VOLATILE_ECC", ECC_VOLATILE))
        flags = fields.get("remapped_rows")  # (pending, failure)
        # else (correctable, uncorrectable, pending, failure)
        rows = (bool(flags[0]), bool(flags[1])) if flags is not None else self._call(
            "remapped_rows", ("nvmlDeviceGetRemappedRows",), conv=_pending_failed)
        if rows is not None:
            gpu.remapped_rows_pending, gpu.remapped_rows_failed = rows
        gpu.pcie_link_gen = self._call("pcie_link_gen", ("nvmlDeviceGetCurrPcieLinkGeneration",))
        gpu.pcie_link_width = self._call("pcie_link_width", ("nvmlDeviceGetCurrPcieLinkWidth",))
        gpu.pcie_link_gen_max = self._gen_max
        gpu.pcie_link_width_max = self._width_max
        links = fields.get("nvlink_errors")
        gpu.nvlink_errors = sum(links) if links is not None else self._nvlink_errors()

    # -- public -------------------------------------------------------------------------------

    def fill(self, gpu: GpuSample) -> None:
        """Write every health field this device gives into ``gpu``; the rest stay unset."""
        with self._lock:
            try:
                if not self._started:
                    self._start()
                self._read(gpu)
            except Exception as exc:  # a stand-in returning nonsense; never the sampler's problem
                log.debug("GPU health read failed: %s", exc)

    def close(self) -> None:
        """Free the XID event set (before ``nvmlShutdown``); later fills report no XIDs."""
        with self._lock:
            events, self._events = self._events, None
            self._off.add("xid_errors")
            self._free(events)

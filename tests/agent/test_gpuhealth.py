"""GPU health fields (PROTOCOL.md section 2, v3) through a stand-in for ``pynvml``.

There is no GPU here, so the stand-in implements the NVML calls the health reader makes with
pynvml's names, signatures, constants and error classes (an ``NVMLError`` carrying ``value``,
subclasses per code). Each test checks one field, one failure mode, or the XID event path,
and counts calls where "never asked again" is the point.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import msgspec
import pytest

from rank_agent import gpuhealth
from rank_agent.gpuhealth import GpuHealth
from rank_agent.protocol import GpuSample, Resources, ResourceSample, decode, encoder
from rank_agent.sampler import Sampler


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's spelling
    def __init__(self) -> None:
        super().__init__(3)


class NVMLError_Timeout(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(10)


class FakeNvml:
    """One healthy NVLink GPU; ``fail`` maps an NVML function name to the error it raises,
    ``missing`` names functions this "pynvml" lacks, ``events`` is the driver's event queue."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Timeout = NVMLError_Timeout
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_NVLINK_MAX_LINKS = 18
    nvmlEventTypeXidCriticalError = 0x08

    def __init__(self, fail=None, missing=(), links=4):
        self.fail = dict(fail or {})
        self.missing = set(missing)
        self.calls: dict[str, int] = {}
        self.reasons = 0
        self.sm_clock = 1980
        self.ecc = 0
        self.rows = (0, 0, 0, 0)
        self.gen, self.gen_max, self.width, self.width_max = 5, 5, 16, 16
        self.links = links
        self.link_errors = {}  # (link, counter) -> count
        self.events: list[SimpleNamespace] = []
        self.registered = None
        self.freed = 0
        self.waits: list[int] = []
        self.field_ids: list[list[int]] = []  # each field-values call's ids
        self.field_fail: dict[int, Exception] = {}  # field id -> the error it reports
        self.gpu = SimpleNamespace(index=0, uuid="GPU-aaaa", name="NVIDIA H100 80GB HBM3", mig=False)

    def __getattribute__(self, name):
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _hit(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail:
            raise self.fail[name]

    # sampler basics
    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self._hit("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpu

    def nvmlDeviceIsMigDeviceHandle(self, h):
        return False

    def nvmlDeviceGetIndex(self, h):
        return 0

    def nvmlDeviceGetName(self, h):
        return h.name

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=90, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=1, total=2)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 70

    def nvmlDeviceGetPowerUsage(self, h):
        return 700_000

    # health
    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._hit("nvmlDeviceGetCurrentClocksEventReasons")
        return self.reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        self._hit("nvmlDeviceGetCurrentClocksThrottleReasons")
        return self.reasons

    def nvmlDeviceGetClockInfo(self, h, clock):
        self._hit("nvmlDeviceGetClockInfo")
        assert clock == 1  # NVML_CLOCK_SM
        return self.sm_clock

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        self._hit("nvmlDeviceGetTotalEccErrors")
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return self.ecc

    def nvmlDeviceGetRemappedRows(self, h):
        self._hit("nvmlDeviceGetRemappedRows")
        return self.rows

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        self._hit("nvmlDeviceGetCurrPcieLinkGeneration")
        return self.gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        self._hit("nvmlDeviceGetMaxPcieLinkGeneration")
        return self.gen_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        self._hit("nvmlDeviceGetCurrPcieLinkWidth")
        return self.width

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        self._hit("nvmlDeviceGetMaxPcieLinkWidth")
        return self.width_max

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._hit("nvmlDeviceGetNvLinkState")
        if self.links == 0:
            raise NVMLError_NotSupported()
        if link >= self.links:
            raise NVMLError(2)  # invalid argument
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        self._hit("nvmlDeviceGetNvLinkErrorCounter")
        return self.link_errors.get((link, counter), 0)

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        """The driver's answers field by field: a field whose own call fails (``fail``) reports
        that call's error code, as NVML does for a query the device does not support; ECC is an
        unsigned long long, the remapped-row flags unsigned ints (``valueType`` 3 and 1)."""
        self._hit("nvmlDeviceGetFieldValues")
        self.field_ids.append(list(field_ids))
        by_counter = {38: 2, 45: 3, 52: 0, 59: 1}  # total field -> NVML_NVLINK_ERROR_DL_*
        own = {4: "nvmlDeviceGetTotalEccErrors", 144: "nvmlDeviceGetRemappedRows",
               145: "nvmlDeviceGetRemappedRows"}
        out = []
        for fid in field_ids:
            err = self.fail.get(own.get(fid, ""), self.field_fail.get(fid))
            if err is not None:
                code = getattr(err, "value", 999)
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=code, valueType=3,
                                           value=SimpleNamespace(ullVal=0, uiVal=0)))
                continue
            if fid == 4:
                kind, value = 3, self.ecc
            elif fid in (144, 145):
                kind, value = 1, self.rows[2 if fid == 144 else 3]
            else:
                kind = 3
                value = sum(v for (link, c), v in self.link_errors.items() if c == by_counter[fid])
            # the union's other members hold garbage: only the one valueType names is the value
            member = {1: {"uiVal": value, "ullVal": value + (7 << 40)}, 3: {"ullVal": value}}[kind]
            out.append(SimpleNamespace(fieldId=fid, nvmlReturn=0, valueType=kind,
                                       value=SimpleNamespace(**member)))
        return out

    def nvmlEventSetCreate(self):
        self._hit("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h, types, events):
        self._hit("nvmlDeviceRegisterEvents")
        self.registered = (h, types, events)

    def nvmlEventSetWait(self, events, timeout_ms):
        self._hit("nvmlEventSetWait")
        self.waits.append(timeout_ms)
        if not self.events:
            raise NVMLError_Timeout()
        return self.events.pop(0)

    def nvmlEventSetFree(self, events):
        self._hit("nvmlEventSetFree")
        self.freed += 1

    def xid(self, code, event_type=0x08):
        self.events.append(SimpleNamespace(device=self.gpu, eventType=event_type, eventData=code))


def _sample(health: GpuHealth) -> GpuSample:
    gpu = GpuSample(device_index=0, name="GPU")
    health.fill(gpu)
    return gpu


def test_every_field_of_a_healthy_gpu():
    nv = FakeNvml()
    g = _sample(GpuHealth(nv, nv.gpu))
    assert g.throttle_reasons == [] and g.xid_errors == []
    assert g.sm_clock_mhz == 1980.0
    assert g.ecc_uncorrected == 0
    assert (g.remapped_rows_pending, g.remapped_rows_failed) == (False, False)
    assert (g.pcie_link_gen, g.pcie_link_gen_max, g.pcie_link_width, g.pcie_link_width_max) == (5, 5, 16, 16)
    assert g.nvlink_errors == 0


@pytest.mark.parametrize(
    ("bits", "names"),
    [
        (0x0, []),
        (0x1, []),  # GPU idle: not health news
        (0x4, ["sw_power_cap"]),
        (0x8 | 0x40, ["hw_slowdown", "hw_thermal"]),
        (0x20 | 0x80 | 0x10 | 0x2, ["sw_thermal", "hw_power_brake"]),  # sync boost, app clocks left out
        (0xFF, ["sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"]),
    ],
)
def test_clock_event_reasons_become_the_contract_names(bits, names):
    nv = FakeNvml()
    nv.reasons = bits
    assert _sample(GpuHealth(nv, nv.gpu)).throttle_reasons == names


def test_older_pynvml_without_event_reasons_uses_throttle_reasons():
    nv = FakeNvml(missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    nv.reasons = 0x40
    assert _sample(GpuHealth(nv, nv.gpu)).throttle_reasons == ["hw_thermal"]
    assert nv.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_ecc_remapped_rows_pcie_and_nvlink_follow_the_device():
    nv = FakeNvml()
    h = GpuHealth(nv, nv.gpu)
    _sample(h)
    nv.ecc, nv.rows = 3, (0, 2, 1, 0)
    nv.width, nv.gen = 8, 3
    nv.link_errors = {(0, 2): 5, (3, 0): 2, (1, 1): 1}
    g = _sample(h)
    assert g.ecc_uncorrected == 3
    assert (g.remapped_rows_pending, g.remapped_rows_failed) == (True, False)
    assert (g.pcie_link_gen, g.pcie_link_width, g.pcie_link_width_max) == (3, 8, 16)
    assert g.nvlink_errors == 8  # CRC + replay + recovery over every link
    nv.rows = (0, 2, 0, 1)
    assert _sample(h).remapped_rows_failed is True
    # the maximum link figures and the active links are read once, not every sample
    assert nv.calls["nvmlDeviceGetMaxPcieLinkWidth"] == 1
    assert nv.calls["nvmlDeviceGetMaxPcieLinkGeneration"] == 1
    assert nv.calls["nvmlDeviceGetNvLinkState"] == 5  # links 0-3 active, 4 is past the device
    assert nv.calls["nvmlDeviceGetFieldValues"] == 3  # one call a sample for all four totals


def test_ecc_remapped_rows_and_nvlink_are_one_field_values_call_a_sample():
    nv = FakeNvml()
    h = GpuHealth(nv, nv.gpu)
    for _ in range(3):
        g = _sample(h)
    assert nv.field_ids == [[4, 144, 145, 38, 45, 52, 59]] * 3
    assert "nvmlDeviceGetTotalEccErrors" not in nv.calls
    assert "nvmlDeviceGetRemappedRows" not in nv.calls
    assert "nvmlDeviceGetNvLinkErrorCounter" not in nv.calls
    # each value read through the member its type names (the flags' other members hold garbage)
    assert (g.ecc_uncorrected, g.remapped_rows_pending, g.remapped_rows_failed) == (0, False, False)
    per_sample = {k: v for k, v in nv.calls.items() if v == 3}
    assert len(per_sample) == 6  # reasons, SM clock, event poll, PCIe gen and width, fields


@pytest.mark.parametrize(
    ("field", "own_call", "rest"),
    [
        (4, "nvmlDeviceGetTotalEccErrors", [144, 145, 38, 45, 52, 59]),
        (145, "nvmlDeviceGetRemappedRows", [4, 38, 45, 52, 59]),
    ],
)
def test_a_field_in_error_goes_back_to_its_own_call_the_others_stay(field, own_call, rest):
    nv = FakeNvml()
    nv.field_fail = {field: NVMLError_NotSupported()}
    nv.ecc, nv.rows = 2, (0, 0, 1, 1)
    nv.link_errors = {(1, 1): 4}
    h = GpuHealth(nv, nv.gpu)
    for _ in range(3):
        g = _sample(h)
        assert (g.ecc_uncorrected, g.remapped_rows_pending, g.remapped_rows_failed) == (2, True, True)
        assert g.nvlink_errors == 4
    assert nv.field_ids[1:] == [rest, rest]
    assert nv.calls[own_call] == 3  # every sample from the first, by its own call


def test_an_nvlink_total_in_error_leaves_the_sum_of_the_others():
    nv = FakeNvml()
    nv.field_fail = {38: NVMLError_NotSupported()}
    nv.link_errors = {(0, 2): 5, (1, 3): 2}  # 38 is CRC_FLIT (counter 2): not readable here
    h = GpuHealth(nv, nv.gpu)
    assert _sample(h).nvlink_errors == 2 and _sample(h).nvlink_errors == 2
    assert nv.field_ids[1] == [4, 144, 145, 38, 45, 52, 59]
    assert "nvmlDeviceGetNvLinkErrorCounter" not in nv.calls


@pytest.mark.parametrize("error", [NVMLError_NotSupported(), NVMLError(999), RuntimeError("boom")])
def test_a_failing_field_values_call_means_every_group_by_its_own_call(error):
    nv = FakeNvml(fail={"nvmlDeviceGetFieldValues": error}, links=1)
    nv.ecc, nv.rows, nv.link_errors = 1, (0, 0, 0, 1), {(0, 0): 3}
    h = GpuHealth(nv, nv.gpu)
    for _ in range(2):
        g = _sample(h)
        assert (g.ecc_uncorrected, g.remapped_rows_failed, g.nvlink_errors) == (1, True, 3)
    assert nv.calls["nvmlDeviceGetFieldValues"] == 1
    assert nv.calls["nvmlDeviceGetTotalEccErrors"] == nv.calls["nvmlDeviceGetRemappedRows"] == 2


def test_field_values_that_make_no_sense_mean_every_group_by_its_own_call():
    nv = FakeNvml()
    good = nv.nvmlDeviceGetFieldValues
    nv.nvmlDeviceGetFieldValues = lambda h, ids: good(h, ids)[:-1]  # one value short
    h = GpuHealth(nv, nv.gpu)
    g = _sample(h)
    assert (g.ecc_uncorrected, g.remapped_rows_pending, g.nvlink_errors) == (0, False, 0)
    _sample(h)
    assert len(nv.field_ids) == 1 and nv.calls["nvmlDeviceGetRemappedRows"] == 2


def test_nvlink_without_field_values_sums_the_per_link_counters():
    nv = FakeNvml(fail={"nvmlDeviceGetFieldValues": NVMLError_NotSupported()}, links=2)
    h = GpuHealth(nv, nv.gpu)
    nv.link_errors = {(0, 0): 1, (1, 3): 4, (5, 0): 100}  # link 5 does not exist: not read
    assert _sample(h).nvlink_errors == 5
    assert _sample(h).nvlink_errors == 5
    assert nv.calls["nvmlDeviceGetFieldValues"] == 1  # given up after the first "not supported"
    assert nv.calls["nvmlDeviceGetNvLinkErrorCounter"] == 2 * 2 * 4


def test_a_gpu_without_nvlink_reports_none_and_probes_once():
    nv = FakeNvml(links=0)
    h = GpuHealth(nv, nv.gpu)
    for _ in range(3):
        assert _sample(h).nvlink_errors is None
    assert nv.calls["nvmlDeviceGetNvLinkState"] == 1
    assert nv.field_ids == [[4, 144, 145]] * 3  # ECC and remapped rows only: no NVLink fields


@pytest.mark.parametrize(
    ("function", "field", "empty"),
    [
        ("nvmlDeviceGetCurrentClocksEventReasons", "throttle_reasons", []),
        ("nvmlDeviceGetClockInfo", "sm_clock_mhz", None),
        ("nvmlDeviceGetTotalEccErrors", "ecc_uncorrected", None),
        ("nvmlDeviceGetRemappedRows", "remapped_rows_pending", None),
        ("nvmlDeviceGetCurrPcieLinkGeneration", "pcie_link_gen", None),
        ("nvmlDeviceGetCurrPcieLinkWidth", "pcie_link_width", None),
        ("nvmlDeviceGetMaxPcieLinkWidth", "pcie_link_width_max", None),
        ("nvmlDeviceGetNvLinkState", "nvlink_errors", None),
    ],
)
@pytest.mark.parametrize("error", [NVMLError_NotSupported(), NVMLError(999), RuntimeError("boom")])
def test_a_failing_call_gives_none_once_and_is_never_retried(function, field, empty, error, caplog):
    nv = FakeNvml(fail={function: error})
    h = GpuHealth(nv, nv.gpu)
    with caplog.at_level(logging.DEBUG, logger="rank_agent.gpuhealth"):
        samples = [_sample(h) for _ in range(4)]
    assert all(getattr(g, field) == empty for g in samples)
    assert nv.calls[function] == 1
    assert len([r for r in caplog.records if "not asked again" in r.getMessage()]) == 1  # said once
    # every other field still arrives
    g = samples[-1]
    assert g.sm_clock_mhz == (None if field == "sm_clock_mhz" else 1980.0)
    assert g.pcie_link_width_max == (None if field == "pcie_link_width_max" else 16)


def test_a_call_missing_from_pynvml_is_not_supported():
    nv = FakeNvml(missing={"nvmlDeviceGetRemappedRows", "nvmlDeviceGetFieldValues",
                           "nvmlDeviceGetNvLinkErrorCounter"})
    h = GpuHealth(nv, nv.gpu)
    g = _sample(h)
    assert g.remapped_rows_failed is None and g.nvlink_errors is None
    assert g.ecc_uncorrected == 0


def test_a_value_that_makes_no_sense_gives_up_that_field_only():
    nv = FakeNvml(missing={"nvmlDeviceGetFieldValues"})  # the rows by their own call
    nv.rows = None  # not a tuple
    h = GpuHealth(nv, nv.gpu)
    g = _sample(h)
    assert g.remapped_rows_pending is None and g.ecc_uncorrected == 0
    _sample(h)
    assert nv.calls["nvmlDeviceGetRemappedRows"] == 1


def test_xid_events_are_polled_without_waiting_and_reported_once():
    nv = FakeNvml()
    h = GpuHealth(nv, nv.gpu)
    assert _sample(h).xid_errors == []
    assert nv.registered == (nv.gpu, 0x08, "event-set")
    nv.xid(79)
    nv.xid(48)
    nv.xid(79)  # a repeat within one sample is one code
    nv.xid(7, event_type=0x01)  # another event type (single-bit ECC) is not an XID
    assert _sample(h).xid_errors == [79, 48]
    assert _sample(h).xid_errors == []  # reported since the previous sample only
    assert set(nv.waits) == {0}  # zero timeout: the sampler never waits
    h.close()
    assert nv.freed == 1
    nv.xid(13)
    assert _sample(h).xid_errors == []  # closed: the set is gone


def test_an_xid_storm_is_bounded():
    nv = FakeNvml()
    h = GpuHealth(nv, nv.gpu)
    for code in range(200):
        nv.xid(code)
    g = _sample(h)
    assert g.xid_errors == list(range(64)) and h.xid_dropped == 136
    for _ in range(gpuhealth.MAX_EVENTS_PER_POLL + 10):
        nv.xid(31)
    assert _sample(h).xid_errors == [31]
    assert len(nv.events) == 10  # the rest waits for the next sample, the poll stays bounded
    assert _sample(h).xid_errors == [31]


@pytest.mark.parametrize("function", ["nvmlDeviceRegisterEvents", "nvmlEventSetCreate"])
def test_xid_registration_not_supported_means_no_xids_and_no_polls(function):
    nv = FakeNvml(fail={function: NVMLError_NotSupported()})
    h = GpuHealth(nv, nv.gpu)
    nv.xid(79)
    assert _sample(h).xid_errors == [] and _sample(h).xid_errors == []
    assert "nvmlEventSetWait" not in nv.calls
    assert nv.freed == (1 if function == "nvmlDeviceRegisterEvents" else 0)


def test_a_failing_event_wait_frees_the_set_and_stops_polling():
    nv = FakeNvml(fail={"nvmlEventSetWait": NVMLError(15)})  # GPU is lost
    h = GpuHealth(nv, nv.gpu)
    assert _sample(h).xid_errors == [] and _sample(h).xid_errors == []
    assert nv.calls["nvmlEventSetWait"] == 1 and nv.freed == 1


def test_the_sampler_sends_health_and_frees_the_event_set_before_shutdown():
    nv = FakeNvml()
    nv.reasons = 0x40
    s = Sampler(0, cuda_visible_devices=None, nvml=nv)
    s.hardware_summary()  # must not drain XIDs meant for a sample
    nv.xid(79)
    s.hardware_summary()
    out = s.sample()
    (gpu,) = out.gpus
    assert gpu.throttle_reasons == ["hw_thermal"] and gpu.xid_errors == [79]
    assert gpu.pcie_link_width == 16 and gpu.nvlink_errors == 0 and gpu.util_percent == 90.0
    order = []
    nv.nvmlEventSetFree = lambda events: order.append("free")
    nv.nvmlShutdown = lambda: order.append("shutdown")
    s.close()
    assert order == ["free", "shutdown"]
    # and the sample crosses the wire as the contract says
    frame = decode(encoder.encode(Resources(run="r", rank=0, sample=out)))
    assert frame.sample.gpus[0] == gpu


def test_wire_bounds_of_the_health_fields():
    ok = GpuSample(device_index=0, name="g", throttle_reasons=["hw_thermal"], xid_errors=[79] * 64)
    assert decode(encoder.encode(Resources(run="r", rank=0, sample=ResourceSample(gpus=[ok])))).sample.gpus == [ok]
    for bad in ({"throttle_reasons": ["idle"]}, {"xid_errors": [1] * 65}, {"xid_errors": [-1]},
                {"throttle_reasons": ["hw_thermal"] * 9}, {"pcie_link_width": 256},
                {"ecc_uncorrected": -1}, {"remapped_rows_failed": "yes"}):
        raw = {"type": "resources", "run": "r", "rank": 0,
               "sample": {"gpus": [{"device_index": 0, "name": "g", **bad}]}}
        with pytest.raises(msgspec.ValidationError):
            decode(msgspec.msgpack.encode(raw))
    # an old agent's sample (no health fields) still decodes, every field absent
    old = {"type": "resources", "run": "r", "rank": 0, "sample": {"gpus": [{"device_index": 0, "name": "g"}]}}
    g = decode(msgspec.msgpack.encode(old)).sample.gpus[0]
    assert g.throttle_reasons == [] and g.xid_errors == [] and g.nvlink_errors is None


def test_field_ids_and_value_layout_are_pynvmls():
    pynvml = pytest.importorskip("pynvml")
    names = {"ecc_uncorrected": ["ECC_DBE_VOL_TOTAL"], "remapped_rows": ["REMAPPED_PENDING", "REMAPPED_FAILURE"],
             "nvlink_errors": [f"NVLINK_{k}_ERROR_COUNT_TOTAL" for k in ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY")]}
    assert {g: tuple(getattr(pynvml, "NVML_FI_DEV_" + n) for n in ns) for g, ns in names.items()} == gpuhealth.FIELD_GROUPS
    # a real c_nvmlFieldValue_t: an unsigned int flag is read as one, whatever the union's rest holds
    v = pynvml.c_nvmlFieldValue_t()
    v.value.ullVal = 7 << 40
    v.value.uiVal = 0
    v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert gpuhealth._field_value(v) == 0
    v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert gpuhealth._field_value(v) == 7 << 40

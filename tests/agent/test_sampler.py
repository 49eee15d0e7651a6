"""The sampler: CUDA_VISIBLE_DEVICES mapping (pure), this machine's CPU/RAM, and the NVML
paths through a stand-in for the third-party ``pynvml`` module (there is no GPU here)."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from rank_agent import sampler as sampler_mod
from rank_agent.sampler import Sampler, cpu_model, parse_visible_devices, visible_device_for

# -- pure mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0,1,2", [0, 1, 2]),
        (" 3 , 1 ", [3, 1]),
        ("2,-1,3", [2]),  # CUDA stops at the first invalid entry
        ("-1", []),
        ("NoDevFiles", []),
        ("GPU-8f3c2b1a-0000-1111-2222-333344445555,1", ["GPU-8f3c2b1a-0000-1111-2222-333344445555", 1]),
        ("MIG-4b6c1d8e-aaaa-bbbb-cccc-ddddeeeeffff", ["MIG-4b6c1d8e-aaaa-bbbb-cccc-ddddeeeeffff"]),
        ("GPU-", []),
        ("0x1", []),
    ],
)
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    ("local_rank", "value", "expected"),
    [
        (0, None, 0),  # unset: the local rank is the NVML index
        (3, None, 3),
        (1, "4,5,6,7", 5),
        (3, "4,5,6,7", 7),
        (4, "4,5,6,7", None),  # past the visible devices: no GPU
        (0, "", None),
        (1, "2,-1", None),
        (0, "GPU-abc", "GPU-abc"),
        (1, "GPU-abc,MIG-def", "MIG-def"),
        (-1, "0", None),
    ],
)
def test_visible_device_for(local_rank, value, expected):
    assert visible_device_for(local_rank, value) == expected


# -- this machine ------------------------------------------------------------------------------


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_cpu_and_ram_are_present():
    s = Sampler(0)
    try:
        psutil.cpu_times()  # some CPU time passes between the priming and the sample
        time.sleep(0.05)
        out = s.sample()
    finally:
        s.close()
    assert out.cpu_percent is not None and 0.0 <= out.cpu_percent <= 100.0
    assert out.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < out.ram_used_bytes <= out.ram_total_bytes


def test_ram_is_read_from_meminfo_and_falls_back_to_psutil(tmp_path, monkeypatch):
    vm = psutil.virtual_memory()
    total, available = sampler_mod.ram_total_available()  # this machine's own /proc/meminfo
    assert total == vm.total and 0 < available <= total
    meminfo = tmp_path / "meminfo"
    meminfo.write_bytes(b"MemTotal:       16384000 kB\nMemFree:         1000 kB\n"
                        b"MemAvailable:    4096000 kB\nBuffers:  1 kB\n" + b"X: 1 kB\n" * 200)
    monkeypatch.setattr(sampler_mod, "MEMINFO", str(meminfo))
    assert sampler_mod.ram_total_available() == (16384000 * 1024, 4096000 * 1024)
    s = Sampler(0, cuda_visible_devices=None, nvml=False)  # no GPU part
    try:
        out = s.sample()
    finally:
        s.close()
    assert (out.ram_total_bytes, out.ram_used_bytes) == (16384000 * 1024, (16384000 - 4096000) * 1024)
    # a kernel without MemAvailable, a file that is not there, a line that is not a number
    for text in (b"MemTotal: 1 kB\nMemFree: 1 kB\n", None, b"MemTotal: lots\nMemAvailable: 1 kB\n"):
        if text is None:
            meminfo.unlink()
        else:
            meminfo.write_bytes(text)
        got = sampler_mod.ram_total_available()
        assert got[0] == vm.total and 0 < got[1] <= vm.total


@pytest.mark.skipif(_nvml_works(), reason="this machine has an NVML driver")
def test_without_nvml_the_gpu_fields_are_absent_and_the_summary_has_no_gpu_part():
    s = Sampler(0, cuda_visible_devices=None)
    try:
        out = s.sample()
        summary = s.hardware_summary()
    finally:
        s.close()
    assert out.gpu_util_percent is None and out.vram_allocated_bytes is None and out.vram_total_bytes is None
    assert out.gpus == []
    assert " | " not in summary
    ram_gb = round(psutil.virtual_memory().total / 1024**3)
    assert summary == f"{cpu_model()} ({os.cpu_count()} threads, {ram_gb} GB)"


def test_nvml_disabled_or_no_visible_gpu_never_touches_nvml():
    class Exploding:
        def __getattr__(self, name):
            raise AssertionError(f"NVML used: {name}")

    for s in (Sampler(0, nvml=False), Sampler(2, cuda_visible_devices="0,1", nvml=Exploding())):
        assert s.sample().gpus == []
        s.close()


def test_sampling_never_imports_torch_and_costs_little():
    s = Sampler(0)
    try:
        s.sample()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            s.sample()
        per_sample = (time.perf_counter() - t0) / n
    finally:
        s.close()
    assert "torch" not in sys.modules
    assert per_sample < 0.01  # generous: measured ~50 us on a 2-core VM


# -- NVML paths through a stand-in pynvml ------------------------------------------------------


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's spelling
    pass


class FakeNvml:
    """Just enough of ``pynvml`` for the sampler: two GPUs, the second split into MIG slices."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, fail=(), init_error=None):
        self.fail = dict(fail)  # field name -> exception to raise
        self.init_error = init_error
        self.inits = self.shutdowns = 0
        self.calls = {}
        self.gpus = [
            SimpleNamespace(index=0, uuid="GPU-aaaa-0000", name=b"NVIDIA H100 80GB HBM3", mig=False),
            SimpleNamespace(index=1, uuid="GPU-bbbb-1111", name="NVIDIA A100-SXM4-40GB", mig=False),
        ]
        self.mig = SimpleNamespace(index=None, uuid="MIG-cccc-2222", name="NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                                   mig=True, parent=self.gpus[1])

    def _hit(self, field):
        self.calls[field] = self.calls.get(field, 0) + 1
        if field in self.fail:
            raise self.fail[field]

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for h in [*self.gpus, self.mig]:
            if h.uuid == uuid:
                return h
        raise NVMLError("not found")

    def nvmlDeviceGetUUID(self, h):
        return h.uuid.encode()

    def nvmlDeviceIsMigDeviceHandle(self, h):
        return h.mig

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h):
        return h.parent

    def nvmlDeviceGetIndex(self, h):
        if h.mig:
            raise NVMLError("no index for a MIG handle")
        return h.index

    def nvmlDeviceGetName(self, h):
        return h.name

    def nvmlDeviceGetUtilizationRates(self, h):
        self._hit("util")
        return SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        self._hit("memory")
        total = 5 * 1024**3 if h.mig else 80 * 1024**3
        return SimpleNamespace(used=1024**3, total=total, free=total - 1024**3)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._hit("temperature")
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        self._hit("power")
        return 312_500  # mW


def test_gpu_by_local_rank_without_cuda_visible_devices():
    nv = FakeNvml()
    s = Sampler(1, cuda_visible_devices=None, nvml=nv)
    out = s.sample()
    assert out.gpu_util_percent == 37.0
    assert (out.vram_allocated_bytes, out.vram_total_bytes) == (1024**3, 80 * 1024**3)
    (gpu,) = out.gpus
    assert (gpu.device_index, gpu.name, gpu.util_percent) == (1, "NVIDIA A100-SXM4-40GB", 37.0)
    assert (gpu.temperature_c, gpu.power_w) == (61.0, 312.5)
    assert s.hardware_summary().endswith(" | NVIDIA A100-SXM4-40GB (80 GB)")
    s.close()
    assert nv.inits == 1 and nv.shutdowns == 1


def test_cuda_visible_devices_maps_local_rank_to_the_physical_index():
    s = Sampler(0, cuda_visible_devices="1,0", nvml=FakeNvml())
    assert s.sample().gpus[0].device_index == 1
    s.close()


def test_gpu_uuid_and_uuid_prefix_resolve():
    for value in ("GPU-aaaa-0000", "GPU-aaaa"):
        s = Sampler(0, cuda_visible_devices=f"{value},1", nvml=FakeNvml())
        (gpu,) = s.sample().gpus
        assert (gpu.device_index, gpu.name) == (0, "NVIDIA H100 80GB HBM3")  # bytes name decoded
        s.close()


def test_mig_instance_reports_its_memory_and_its_parent_index():
    s = Sampler(0, cuda_visible_devices="MIG-cccc-2222", nvml=FakeNvml())
    (gpu,) = s.sample().gpus
    assert gpu.device_index == 1 and gpu.name.endswith("MIG 1g.5gb")
    assert gpu.vram_total_bytes == 5 * 1024**3
    s.close()


def test_local_rank_past_the_gpus_means_no_gpu():
    s = Sampler(5, cuda_visible_devices=None, nvml=FakeNvml())
    assert s.sample().gpus == [] and " | " not in s.hardware_summary()
    s.close()


def test_unresolvable_uuid_means_no_gpu():
    s = Sampler(0, cuda_visible_devices="GPU-zzzz", nvml=FakeNvml())
    assert s.sample().gpus == []
    s.close()


def test_nvml_init_failure_means_no_gpu_and_no_retry():
    nv = FakeNvml(init_error=NVMLError("driver not loaded"))
    s = Sampler(0, cuda_visible_devices=None, nvml=nv)
    assert s.sample().gpus == [] and s.sample().gpus == []
    assert s.sample().ram_total_bytes
    s.close()
    assert nv.shutdowns == 0


def test_one_failing_field_leaves_only_that_field_absent():
    nv = FakeNvml(fail={"power": NVMLError_NotSupported(), "temperature": NVMLError("transient")})
    s = Sampler(0, cuda_visible_devices=None, nvml=nv)
    for _ in range(3):
        out = s.sample()
    (gpu,) = out.gpus
    assert gpu.power_w is None and gpu.temperature_c is None
    assert gpu.util_percent == 37.0 and gpu.vram_total_bytes == 80 * 1024**3
    assert nv.calls["power"] == 1  # "not supported" is not asked again
    assert nv.calls["temperature"] == 3  # other errors are retried next sample
    s.close()


def test_summary_never_contains_the_separator_inside_a_part():
    nv = FakeNvml()
    nv.gpus[0].name = "Weird | GPU"
    s = Sampler(0, cuda_visible_devices=None, nvml=nv)
    assert s.hardware_summary().count(" | ") == 1
    s.close()

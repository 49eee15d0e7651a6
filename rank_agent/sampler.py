"""Resource sampling for one training rank: host CPU/RAM through psutil, its own GPU through NVML.

Runs inside a training process, so it is written as a guest:

* it never imports torch and never creates a CUDA context: the GPU is read through NVML
  (``pynvml``, from the ``nvidia-ml-py`` package), which talks to the driver only;
* ``pynvml`` is imported lazily, on the first GPU read, and any failure (module missing, no
  driver, NVML error) simply leaves the GPU fields absent; a later error on one field leaves
  only that field absent;
* a sample costs a couple of ``/proc`` reads and a handful of NVML calls (well under a
  millisecond), and never sleeps: CPU % is the busy share of the CPU time elapsed since the
  previous sample, computed from two ``psutil.cpu_times()`` readings kept by this object
  (``psutil.cpu_percent(interval=None)`` keeps its previous reading per *thread* in recent
  psutil releases and globally in older ones, so it cannot be primed in one thread and read in
  another reliably, and other code in the process may call it too).

Which GPU is "the rank's own": CUDA numbers the devices a process may use by their position in
``CUDA_VISIBLE_DEVICES``; a rank conventionally uses visible device ``LOCAL_RANK``. The pure
function :func:`visible_device_for` maps a local rank to the entry of ``CUDA_VISIBLE_DEVICES``
(an NVML index, or a ``GPU-``/``MIG-`` UUID that NVML resolves). Integer entries are taken as
NVML indices, which are in PCI bus order; CUDA enumerates in that order only with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (what every cluster launcher we know of sets, and what
single-GPU-per-rank setups make moot), so on a machine with mixed GPU models and the default
"fastest first" order the mapping can differ from CUDA's; pass UUIDs in
``CUDA_VISIBLE_DEVICES`` to make it exact.
"""
from __future__ import annotations

import logging
import os
import platform
import threading
from typing import Any, Callable, List, Union

import psutil

from .gpuhealth import GpuHealth
from .protocol import MAX_SHORT, MAX_SUMMARY, GpuSample, ResourceSample

log = logging.getLogger(__name__)

_GIB = 1024**3

VisibleDevice = Union[int, str]

_UNSET: Any = object()


def parse_visible_devices(value: str | None) -> List[VisibleDevice] | None:
    """Parse ``CUDA_VISIBLE_DEVICES`` the way the CUDA runtime does.

    Returns ``None`` when the variable is unset (every device visible, in NVML order), else
    the list of visible devices: ``int`` for an index, ``str`` for a ``GPU-``/``MIG-`` UUID
    (possibly a unique prefix, which CUDA also accepts). Like CUDA, parsing stops at the first
    entry that is neither (e.g. ``-1``, ``NoDevFiles``), so ``"0,-1,2"`` is ``[0]`` and ``""``
    is ``[]`` (no device).
    """
    if value is None:
        return None
    out: List[VisibleDevice] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isdigit() and entry.isascii():
            out.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
            out.append(entry)
        else:
            break
    return out


def visible_device_for(local_rank: int, cuda_visible_devices: str | None) -> VisibleDevice | None:
    """The device of a rank with ``local_rank``: an NVML index, a UUID to resolve, or ``None``.

    With ``CUDA_VISIBLE_DEVICES`` unset the rank's device is NVML index ``local_rank``
    (whether it exists is checked against NVML later). With it set, it is the entry at
    position ``local_rank``; a local rank past the visible devices has no GPU.
    """
    if local_rank < 0:
        return None
    visible = parse_visible_devices(cuda_visible_devices)
    if visible is None:
        return local_rank
    if local_rank >= len(visible):
        return None
    return visible[local_rank]


def _clean(text: str, limit: int) -> str:
    """One-line text without ``|`` (the summary's separator), at most ``limit`` characters."""
    text = " ".join(text.replace("|", "/").split())
    return text[:limit]


def cpu_model() -> str:
    """The CPU's marketing name: ``/proc/cpuinfo`` "model name", else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return _clean(value, MAX_SHORT)
    except OSError:
        pass
    name = platform.processor() or platform.machine()
    return _clean(name, MAX_SHORT) if name else "unknown CPU"


#: Linux's memory figures. Read directly: ``psutil.virtual_memory()`` parses every line of it
#: and computes a dozen figures a sample does not carry (21 us a call here, against ~8 us).
MEMINFO = "/proc/meminfo"


def ram_total_available() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes: the first lines of :data:`MEMINFO`, else (no such
    file, or a kernel before 3.14 without MemAvailable) ``psutil.virtual_memory()``'s."""
    total = available = None
    try:
        with open(MEMINFO, "rb") as fh:
            head = fh.read(1024)
        for line in head.split(b"\n")[:-1]:  # (a line the read may have cut is left out)
            key, _, rest = line.partition(b":")
            if key == b"MemTotal":
                total = int(rest.split()[0]) * 1024
            elif key == b"MemAvailable":
                available = int(rest.split()[0]) * 1024
                break
    except (OSError, ValueError, IndexError):
        total = None
    if total is None or available is None:
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    return total, available


def _cpu_total_and_busy(times: Any) -> tuple[float, float]:
    """Total and busy CPU seconds of a ``psutil.cpu_times()`` reading (psutil's own formula).

    Guest time is already counted in user/nice on Linux, so it is not added twice; idle and
    iowait are not busy.
    """
    total = float(sum(times))
    total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    busy = total - times.idle - getattr(times, "iowait", 0.0)
    return total, busy


class Sampler:
    """Samples the host's CPU and RAM and this rank's own GPU; cheap, non-blocking, never raises.

    Constructing it reads ``/proc`` once to prime the CPU % baseline, so the first
    :meth:`sample` reports the CPU use since construction. NVML is initialised lazily on the
    first GPU read (:meth:`sample`, :meth:`hardware_summary`) and shut down by :meth:`close`.

    ``cuda_visible_devices`` defaults to the environment's ``CUDA_VISIBLE_DEVICES`` at
    construction; ``nvml`` is the ``pynvml`` module (injectable so that the UUID, MIG and
    error paths can be exercised without a GPU); ``nvml=False`` disables the GPU part.
    """

    def __init__(
        self,
        local_rank: int = 0,
        *,
        cuda_visible_devices: str | None = _UNSET,
        nvml: Any = None,
    ) -> None:
        self.local_rank = local_rank
        if cuda_visible_devices is _UNSET:
            cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.cuda_visible_devices: str | None = cuda_visible_devices
        self._nvml: Any = nvml
        self._gpu_state = "off" if nvml is False else "unknown"  # -> "ok" | "none"
        self._handle: Any = None  # the handle NVML reads utilisation etc. from
        self._mem_handle: Any = None  # the MIG instance for a MIG device, else the same handle
        self._nvml_inited = False
        self.gpu_index: int | None = None
        self.gpu_name: str | None = None
        self._unsupported: set = set()  # GPU fields NVML said "not supported" for: not retried
        self._health: GpuHealth | None = None  # the health fields' reader, made on first use
        self._lock = threading.Lock()
        self._last_cpu = _cpu_total_and_busy(psutil.cpu_times())

    # -- CPU / RAM ---------------------------------------------------------------------------

    def _cpu_percent(self) -> float | None:
        now = _cpu_total_and_busy(psutil.cpu_times())
        total = now[0] - self._last_cpu[0]
        busy = now[1] - self._last_cpu[1]
        self._last_cpu = now
        if total <= 0.0:
            return None  # no CPU time elapsed since the previous reading: no meaningful figure
        return round(min(100.0, max(0.0, 100.0 * busy / total)), 1)

    # -- GPU ---------------------------------------------------------------------------------

    def _init_gpu(self) -> None:
        """Find this rank's GPU through NVML, once; on any failure there is simply no GPU."""
        if self._gpu_state != "unknown":
            return
        self._gpu_state = "none"
        target = visible_device_for(self.local_rank, self.cuda_visible_devices)
        if target is None:
            return
        try:
            if self._nvml is None:
                import pynvml  # lazy: a CPU-only process never loads it

                self._nvml = pynvml
            nv = self._nvml
            nv.nvmlInit()
            self._nvml_inited = True
            handle = self._resolve(nv, target)
            if handle is None:
                return
            mem_handle = handle
            try:
                is_mig = bool(nv.nvmlDeviceIsMigDeviceHandle(handle))
            except Exception:
                is_mig = False
            if is_mig:
                # a MIG instance: memory is the instance's own; utilisation, temperature and
                # power are only readable on (and describe) the parent GPU.
                handle = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            index = int(nv.nvmlDeviceGetIndex(handle))
            try:
                name = nv.nvmlDeviceGetName(mem_handle)
                if isinstance(name, bytes):
                    name = name.decode("utf-8", "replace")
                name = _clean(str(name), MAX_SHORT) or f"GPU {index}"
            except Exception:
                name = f"GPU {index}"
        except Exception as exc:  # ImportError, NVMLError (no driver), anything else
            log.info("no GPU figures for local rank %s: %s", self.local_rank, exc)
            self._shutdown_nvml()
            return
        self._handle, self._mem_handle = handle, mem_handle
        self.gpu_index, self.gpu_name = index, name
        self._gpu_state = "ok"

    def _resolve(self, nv: Any, target: VisibleDevice) -> Any:
        """An NVML handle for an index or a (possibly abbreviated) UUID, or ``None``."""
        if isinstance(target, int):
            if target >= int(nv.nvmlDeviceGetCount()):
                log.info("local rank %s: GPU %s does not exist", self.local_rank, target)
                return None
            return nv.nvmlDeviceGetHandleByIndex(target)
        try:
            return nv.nvmlDeviceGetHandleByUUID(target)
        except Exception:
            pass
        # CUDA also accepts a unique prefix of a GPU UUID; NVML wants the whole UUID.
        matches = []
        for i in range(int(nv.nvmlDeviceGetCount())):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = nv.nvmlDeviceGetUUID(h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode("ascii", "replace")
            if str(uuid).startswith(target):
                matches.append(h)
        if len(matches) == 1:
            return matches[0]
        log.info("local rank %s: cannot resolve GPU %r through NVML", self.local_rank, target)
        return None

    def _read(self, field: str, fn: Any, *args: Any) -> Any:
        """One NVML read; an error leaves that field absent (and "not supported" stops retries)."""
        if field in self._unsupported:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            nv = self._nvml
            not_supported = getattr(nv, "NVMLError_NotSupported", None)
            if isinstance(not_supported, type) and isinstance(exc, not_supported):
                self._unsupported.add(field)
            log.debug("NVML %s failed: %s", field, exc)
            return None

    def gpu_sample(self) -> GpuSample | None:
        """This rank's GPU now, or ``None`` when it has none (or NVML is unavailable)."""
        with self._lock:
            self._init_gpu()
        if self._gpu_state != "ok":
            return None
        nv = self._nvml
        gpu = GpuSample(device_index=int(self.gpu_index or 0), name=self.gpu_name or "GPU")
        util = self._read("util", nv.nvmlDeviceGetUtilizationRates, self._handle)
        if util is not None:
            gpu.util_percent = float(util.gpu)
        mem = self._read("memory", nv.nvmlDeviceGetMemoryInfo, self._mem_handle)
        if mem is not None:
            gpu.vram_allocated_bytes = int(mem.used)
            gpu.vram_total_bytes = int(mem.total)
        temp = self._read("temperature", nv.nvmlDeviceGetTemperature, self._handle, nv.NVML_TEMPERATURE_GPU)
        if temp is not None:
            gpu.temperature_c = float(temp)
        power = self._read("power", nv.nvmlDeviceGetPowerUsage, self._handle)
        if power is not None:
            gpu.power_w = float(power) / 1000.0
        return gpu

    # -- public ------------------------------------------------------------------------------

    def sample(self) -> ResourceSample:
        """One :class:`ResourceSample`; a figure that cannot be read is left ``None``."""
        out = ResourceSample()
        try:
            out.cpu_percent = self._cpu_percent()
        except Exception as exc:
            log.debug("cpu_times failed: %s", exc)
        try:
            total, available = ram_total_available()
            out.ram_total_bytes = total
            out.ram_used_bytes = max(0, total - available)
        except Exception as exc:
            log.debug("virtual_memory failed: %s", exc)
        try:
            gpu = self.gpu_sample()
        except Exception as exc:
            log.debug("GPU sample failed: %s", exc)
            gpu = None
        if gpu is not None:
            # health in sample() only (not gpu_sample(), which hardware_summary() also calls):
            # XID events are drained once, into the sample that is sent
            if self._health is None:
                self._health = GpuHealth(self._nvml, self._handle)
            self._health.fill(gpu)
            out.gpu_util_percent = gpu.util_percent
            out.vram_allocated_bytes = gpu.vram_allocated_bytes
            out.vram_total_bytes = gpu.vram_total_bytes
            out.gpus = [gpu]
        return out

    def hardware_summary(self) -> str:
        """``"<cpu model> (<threads> threads, <R> GB) | <gpu name> (<V> GB)"``.

        GB here are binary (GiB) rounded, as RAM and GPU memory sizes are quoted; without a
        GPU only the CPU part is given. At most 4096 characters (the wire limit).
        """
        try:
            ram = f", {round(psutil.virtual_memory().total / _GIB)} GB"
        except Exception:
            ram = ""
        cpu = f"{cpu_model()} ({os.cpu_count() or 1} threads{ram})"
        try:
            gpu = self.gpu_sample()
        except Exception:
            gpu = None
        if gpu is None:
            return cpu[:MAX_SUMMARY]
        part = gpu.name
        if gpu.vram_total_bytes:
            part += f" ({round(gpu.vram_total_bytes / _GIB)} GB)"
        return f"{cpu} | {part}"[:MAX_SUMMARY]

    def _shutdown_nvml(self) -> None:
        if self._nvml_inited:
            self._nvml_inited = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def close(self) -> None:
        """Release NVML (reference counted by NVML, so other users in the process are unaffected)."""
        with self._lock:
            if self._health is not None:
                self._health.close()  # frees the XID event set before nvmlShutdown
            self._shutdown_nvml()
            if self._gpu_state == "ok":
                self._gpu_state = "none"
            self._handle = self._mem_handle = None


class SamplingThread:
    """A rank's periodic resource sampling: a daemon thread taking a :class:`Sampler`
    sample every ``interval`` seconds and handing it to ``send``; the latest one is kept
    for ``log_epoch``.

    Apart from the agent because it is the one part of the agent that owns a thread of its
    own and the sampler's NVML handles; the agent only starts it, reads :attr:`latest`
    and stops it. ``warn(key, fmt, *args)`` is the agent's rate-limited warning.
    """

    def __init__(self, local_rank: int, name: str, send: Callable[[ResourceSample], Any],
                 warn: Callable[..., Any]) -> None:
        self.local_rank = local_rank
        self.name = name
        self._send = send
        self._warn = warn
        #: the sampler (created on first need; a test or the demo may put its own)
        self.sampler: Any = None
        #: the most recent sample (None before the first)
        self.latest: ResourceSample | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def get_sampler(self) -> Any:
        if self.sampler is None:
            self.sampler = Sampler(self.local_rank)
        return self.sampler

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval: float) -> None:
        """Start sampling every ``interval`` seconds (at least 0.1); the first sample after
        ``min(interval, 0.5)`` s so that its CPU % covers a real interval."""
        interval = max(0.1, float(interval))
        sampler = self.get_sampler()
        stop = self._stop = threading.Event()
        thread = threading.Thread(target=self._loop, args=(sampler, stop, interval),
                                  name=self.name, daemon=True)
        thread.start()
        self._thread = thread

    def _loop(self, sampler: Any, stop: threading.Event, interval: float) -> None:
        wait = min(interval, 0.5)
        while not stop.wait(wait):
            wait = interval
            try:
                sample = sampler.sample()
            except Exception as exc:  # Sampler.sample already guards each figure
                self._warn("sample", "rankboard: resource sample failed: %r", exc)
                continue
            self.latest = sample
            self._send(sample)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (joined, unless this is it) and release the sampler's handles."""
        thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)
        self._thread = None
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            try:
                sampler.close()
            except Exception:
                pass

    def reset_after_fork(self) -> None:
        """In a forked child: threads do not survive fork, and the NVML handles are the
        parent's; forget both without touching them."""
        self._thread = None
        self._stop = threading.Event()
        self.sampler = None

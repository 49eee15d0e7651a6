"""The rank -> broker wire: one tagged union of msgspec Structs (PROTOCOL.md section 2).

This module is the single source of truth for the frames a training rank sends. It
imports only msgspec so that both the agent (inside a training process) and the broker
can share it. Limits that msgspec can express as constraints are declared on the types,
so a frame over them fails decoding; the byte-size limits of ``svg`` and metadata
``json`` (UTF-8 bytes, not characters) are checked by :func:`check_limits` after decoding.

Encoders and decoders are built once here and reused: building them is the expensive part.
Every Struct is ``gc=False`` (msgspec: never tracked by the cycle collector): frames are
trees of numbers and strings that cannot form a cycle, and the broker keeps many of them
(latest samples, pending step frames); measured, decoding and keeping a resources frame went
from 3.1 to 1.8 us, the difference being collector passes over the kept frames.
"""
from __future__ import annotations

import re
from operator import lt as _lt
from typing import Annotated, Any, Callable, Literal, Optional, Union

import msgspec
from msgspec import Meta

#: The default endpoints (PROTOCOL 1), defined here once because this is the one module both
#: sides of the wire import: the agent pushes to ingest, the broker binds all three, the web
#: reads publish and snapshot.
DEFAULT_INGEST = "tcp://127.0.0.1:5585"
DEFAULT_PUBLISH = "tcp://127.0.0.1:5586"
DEFAULT_SNAPSHOT = "tcp://127.0.0.1:5587"

#: Largest ZeroMQ message the broker accepts (``ZMQ_MAXMSGSIZE``).
MAX_FRAME_BYTES = 4 * 1024 * 1024
#: Largest ``svg`` payload, in UTF-8 bytes.
MAX_SVG_BYTES = 2 * 1024 * 1024
#: Largest metadata ``json`` payload, in UTF-8 bytes.
MAX_METADATA_BYTES = 1 * 1024 * 1024
MAX_WORLD_SIZE = 65536
#: Longest run id, in characters.
MAX_RUN_ID = 128
#: Longest host, label, hash and GPU name, in characters.
MAX_SHORT = 256
#: A register's ``label`` (section 7.5): a longer one rejects the frame as ``schema``.
MAX_LABEL = 128
#: Longest hardware summary, in characters.
MAX_SUMMARY = 4096
#: Most scalars in one metrics frame, and the longest scalar name.
MAX_SCALARS = 256
MAX_SCALAR_NAME = 128
#: Most points (optimizer steps) in one ``steps`` frame, most metric names in one, and the
#: longest metric name.
MAX_STEP_POINTS = 1024
MAX_STEP_METRICS = 64
#: (8.3) replicated step metric names a register may list (and a run holds)
MAX_REPLICATED = 64
MAX_STEP_METRIC_NAME = 128
#: (v5, 8.1) a register's ``proc`` (the sending process's id): a longer one is ``schema``
MAX_PROC = 64
#: Largest step number (steps are stored as signed 64-bit integers) and largest per-point
#: ``samples``/``tokens`` (so a sum over 65,536 ranks still fits in 64 bits).
MAX_STEP = 2**63 - 1
MAX_STEP_COUNT = 2**40

#: The characters a run id is made of (PROTOCOL.md 2), as a regex character-class body.
#: Everything that checks or cleans a run id builds on this and :data:`RUN_ID_PATTERN`.
RUN_ID_CHARS = r"A-Za-z0-9._:\-"
#: The whole run id (contract v3): 1-``MAX_RUN_ID`` of :data:`RUN_ID_CHARS` and not dots
#: only (``.`` and ``..`` name no file and no URL path segment). Anchored with ``\Z``, not
#: ``$``: ``$`` also matches before a trailing newline, which would let ``"run\n"`` in.
#: Written for ``re.search``, which is how msgspec applies a ``pattern``.
RUN_ID_PATTERN = rf"^(?!\.+\Z)[{RUN_ID_CHARS}]{{1,{MAX_RUN_ID}}}\Z"
#: :data:`RUN_ID_PATTERN` compiled: ``RUN_ID_RE.search(text)`` (or :func:`valid_run_id`).
RUN_ID_RE = re.compile(RUN_ID_PATTERN)


def valid_run_id(run: object) -> bool:
    """True when ``run`` is a string the wire accepts as a run id (the one check: the
    frames' ``RunId``, the web's routes and the journal's file names must agree)."""
    return isinstance(run, str) and RUN_ID_RE.search(run) is not None


RunId = Annotated[str, Meta(pattern=RUN_ID_PATTERN)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]
NonNegInt = Annotated[int, Meta(ge=0)]
Short = Annotated[str, Meta(max_length=MAX_SHORT)]
ScalarName = Annotated[str, Meta(max_length=MAX_SCALAR_NAME)]
ScalarValue = tuple[float, Annotated[int, Meta(ge=0)]]

#: The clock event reasons a ``GpuSample`` may name (PROTOCOL.md section 2), in NVML bit order.
THROTTLE_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
ThrottleReason = Literal["sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"]
#: Most throttle reasons and XID codes in one ``GpuSample`` (there are five reasons; an agent
#: reports at most 64 XIDs a sample and counts the rest as dropped).
MAX_THROTTLE_REASONS = 8
MAX_XID_ERRORS = 64
XidCode = Annotated[int, Meta(ge=0, le=2**32 - 1)]
#: PCIe generation or lane count: small numbers; 255 leaves room for any future link.
PcieFigure = Annotated[int, Meta(ge=0, le=255)]


class GpuSample(msgspec.Struct, omit_defaults=True, gc=False):
    """One GPU as NVML sees it. ``device_index`` is the physical NVML index on the rank's host."""

    device_index: NonNegInt
    name: Short
    util_percent: Optional[float] = None
    vram_allocated_bytes: Optional[NonNegInt] = None
    vram_total_bytes: Optional[NonNegInt] = None
    temperature_c: Optional[float] = None
    power_w: Optional[float] = None
    # GPU health (contract v3, PROTOCOL.md section 2): absent/None where the device or driver
    # cannot say. Bounds are generous (a frame over them is rejected, never truncated).
    sm_clock_mhz: Optional[float] = None
    throttle_reasons: Annotated[list[ThrottleReason], Meta(max_length=MAX_THROTTLE_REASONS)] = []
    xid_errors: Annotated[list[XidCode], Meta(max_length=MAX_XID_ERRORS)] = []
    ecc_uncorrected: Optional[NonNegInt] = None
    remapped_rows_pending: Optional[bool] = None
    remapped_rows_failed: Optional[bool] = None
    pcie_link_gen: Optional[PcieFigure] = None
    pcie_link_gen_max: Optional[PcieFigure] = None
    pcie_link_width: Optional[PcieFigure] = None
    pcie_link_width_max: Optional[PcieFigure] = None
    nvlink_errors: Optional[NonNegInt] = None


class ResourceSample(msgspec.Struct, omit_defaults=True, gc=False):
    """A rank's latest view of its host and its own GPU; every field may be absent."""

    cpu_percent: Optional[float] = None
    ram_used_bytes: Optional[NonNegInt] = None
    ram_total_bytes: Optional[NonNegInt] = None
    gpu_util_percent: Optional[float] = None
    vram_allocated_bytes: Optional[NonNegInt] = None
    vram_total_bytes: Optional[NonNegInt] = None
    gpus: Annotated[list[GpuSample], Meta(max_length=64)] = []


class _Frame(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """Every frame names its run and the sending rank."""

    run: RunId
    rank: Rank


class Register(_Frame, tag="register"):
    world_size: Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]
    host: Short
    local_rank: NonNegInt = 0
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    total_epochs: NonNegInt = 0
    pid: NonNegInt = 0
    #: The run's readable name (section 7.5); "" = none.
    label: Annotated[str, Meta(max_length=MAX_LABEL)] = ""
    #: (v5, 8.5) the run's optimizer steps in all, for the step-run ETA; 0 = unknown.
    total_steps: NonNegInt = 0
    #: (8.3) step metrics every rank computes to the same value by construction (the
    #: gradient norm after the all-reduce): the broker checks them for replicas that disagree.
    replicated: Annotated[list[Annotated[str, Meta(max_length=MAX_STEP_METRIC_NAME)]],
                          Meta(max_length=MAX_REPLICATED)] = []
    #: (v5, 8.1) an id of the sending process, different in every process ("" = unknown):
    #: a rank's new process starts a new attempt of the run.
    proc: Annotated[str, Meta(max_length=MAX_PROC)] = ""


class Svg(_Frame, tag="svg"):
    svg: Annotated[str, Meta(max_length=MAX_SVG_BYTES)]
    label: Optional[Short] = None
    hash: Optional[Short] = None


class Metadata(_Frame, tag="metadata"):
    json: Annotated[str, Meta(max_length=MAX_METADATA_BYTES)]


class Hardware(_Frame, tag="hardware"):
    summary: Annotated[str, Meta(max_length=MAX_SUMMARY)]


class Resources(_Frame, tag="resources"):
    sample: ResourceSample


class Metrics(_Frame, tag="metrics"):
    epoch: NonNegInt
    avg_loss: float
    batches: NonNegInt = 0
    samples: NonNegInt = 0
    epoch_ms: float = 0.0
    share_complete_ms: Optional[float] = None
    scalars: Annotated[dict[ScalarName, ScalarValue], Meta(max_length=MAX_SCALARS)] = {}
    resources: Optional[ResourceSample] = None




StepNumber = Annotated[int, Meta(ge=0, le=MAX_STEP)]
StepList = Annotated[list[StepNumber], Meta(min_length=1, max_length=MAX_STEP_POINTS)]
StepMetricName = Annotated[str, Meta(max_length=MAX_STEP_METRIC_NAME)]
OptFloats = Annotated[list[Optional[float]], Meta(max_length=MAX_STEP_POINTS)]
#: ``data_ms`` values: a wait is a number of ms >= 0 (or null); a negative or NaN one is no
#: measurement and made a negative ``data_share`` (issue 38), so the frame is ``schema``.
Waits = Annotated[list[Optional[Annotated[float, Meta(ge=0)]]], Meta(max_length=MAX_STEP_POINTS)]
Counts = Annotated[list[Annotated[int, Meta(ge=0, le=MAX_STEP_COUNT)]],
                   Meta(max_length=MAX_STEP_POINTS)]


class Steps(_Frame, tag="steps"):
    """Columnar per-step points: entry ``i`` of every list describes ``steps[i]``.

    Lists of equal length and strictly increasing steps are checked by
    :func:`check_limits` (msgspec constraints cannot relate two fields). ``samples`` and
    ``tokens`` may be ``[]`` (not sent); a metric's ``None`` means "not logged at that step".
    """

    steps: StepList
    times: Annotated[list[float], Meta(max_length=MAX_STEP_POINTS)]
    step_ms: OptFloats
    samples: Counts = []
    tokens: Counts = []
    metrics: Annotated[dict[StepMetricName, OptFloats], Meta(max_length=MAX_STEP_METRICS)] = {}
    #: (v4, 7.1) per point, the ms the loop waited for that step's batch; ``[]``: not sent
    data_ms: Waits = []


#: ``stacks`` limits (PROTOCOL.md section 2): threads per dump, frames per thread, characters
#: of ``file``/``function``/``code``/``name``, profile entries, entries per profile stack,
#: characters of ``request_id``.
MAX_STACK_THREADS = 128
MAX_STACK_FRAMES = 256
MAX_STACK_TEXT = 512
MAX_PROFILE_ENTRIES = 2000
MAX_PROFILE_DEPTH = 256
MAX_REQUEST_ID = 64

StackText = Annotated[str, Meta(max_length=MAX_STACK_TEXT)]


class StackFrame(msgspec.Struct, omit_defaults=True, gc=False):
    """One Python frame of a dumped thread; ``code`` is the source line, stripped."""

    file: StackText
    line: int
    function: StackText
    code: StackText = ""


class ThreadStack(msgspec.Struct, omit_defaults=True, gc=False):
    """One thread of a dump: outermost frame first, innermost last (as a traceback prints);
    ``main`` marks the training thread (PROTOCOL.md section 2.5)."""

    name: StackText
    frames: Annotated[list[StackFrame], Meta(max_length=MAX_STACK_FRAMES)]
    main: bool = False


class ProfileEntry(msgspec.Struct, omit_defaults=True, gc=False):
    """One distinct main-thread stack of a profile and how many samples saw it. Each entry
    of ``stack`` is ``"<function> (<file>:<line>)"``, outermost first. The contract bounds
    their number, not their length (the 4 MiB frame limit does); the agent builds them from
    a function and a file each cut at 512 characters."""

    stack: Annotated[list[str], Meta(max_length=MAX_PROFILE_DEPTH)]
    count: Annotated[int, Meta(ge=1)]


class Stacks(_Frame, tag="stacks"):
    """A dump of the rank process's Python stacks (section 2.5): a ``stall`` dump from the
    stall watch, or the ``request`` answer to ``request_id`` (a dump in ``threads``, or a
    profile in ``profile`` with ``samples`` taken over ``seconds``)."""

    reason: Literal["stall", "request"]
    taken_at: float
    request_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID)] = ""
    idle_s: Annotated[float, Meta(ge=0)] = 0.0  # NaN and negatives: schema (issue 32)
    threads: Annotated[list[ThreadStack], Meta(max_length=MAX_STACK_THREADS)] = []
    profile: Annotated[list[ProfileEntry], Meta(max_length=MAX_PROFILE_ENTRIES)] = []
    samples: NonNegInt = 0
    seconds: float = 0.0


#: ``ErrorInfo`` bounds (PROTOCOL.md section 8.2): characters of the exception's qualified
#: type and of its message, frames of its traceback (the innermost; each frame's strings as a
#: ``stacks`` frame's, :data:`MAX_STACK_TEXT`).
MAX_ERROR_TYPE = 256
MAX_ERROR_MESSAGE = 4096
MAX_ERROR_FRAMES = 64


class ErrorInfo(msgspec.Struct, omit_defaults=True, gc=False):
    """Why a rank failed (section 8.2): the exception's class as ``<module>.<qualname>``
    (``builtins`` left out), ``str()`` of it, its traceback outermost first as
    ``traceback.extract_tb`` gives it (the agent sends the innermost 64), and ``at``, the
    unix time it was caught (the broker takes the ``finish``'s arrival for a non-finite
    ``at`` or one later than that arrival: the first failure is judged by it)."""

    type: Annotated[str, Meta(max_length=MAX_ERROR_TYPE)]
    message: Annotated[str, Meta(max_length=MAX_ERROR_MESSAGE)]
    at: float
    frames: Annotated[list[StackFrame], Meta(max_length=MAX_ERROR_FRAMES)] = []


class Finish(_Frame, tag="finish"):
    status: Literal["ok", "error"] = "ok"
    #: (v5, 8.2) the exception that ended the rank; ignored on a finish with status ``ok``
    error: Optional[ErrorInfo] = None


#: ``collectives`` bounds (PROTOCOL.md section 7.2): groups per frame, entries per group (the
#: newest), characters of every string, dimensions per size, sizes per entry.
MAX_COLLECTIVE_GROUPS = 64
MAX_COLLECTIVE_ENTRIES = 64
MAX_COLLECTIVE_TEXT = 128
MAX_SIZE_DIMS = 16
MAX_ENTRY_SIZES = 16

CollectiveText = Annotated[str, Meta(max_length=MAX_COLLECTIVE_TEXT)]
TensorSize = Annotated[list[int], Meta(max_length=MAX_SIZE_DIMS)]


class ProcessGroupStatus(msgspec.Struct, omit_defaults=True, gc=False):
    """One process group as the Flight Recorder reports it: collective sequence numbers of
    the last collective enqueued and completed (-1: none)."""

    pg: CollectiveText
    desc: CollectiveText = ""
    size: NonNegInt = 0
    last_enqueued: int = -1
    last_completed: int = -1


class CollectiveEntry(msgspec.Struct, omit_defaults=True, gc=False):
    """One collective of the Flight Recorder's ring: its group, ``collective_seq_id`` and
    ``profiling_name`` (e.g. ``gloo:all_reduce``)."""

    pg: CollectiveText
    seq: int
    op: CollectiveText
    input_sizes: Annotated[list[TensorSize], Meta(max_length=MAX_ENTRY_SIZES)] = []
    state: CollectiveText = ""
    retired: bool = False


class Collectives(_Frame, tag="collectives"):
    """The rank's process groups and their newest collectives (section 7.2), sent with each
    ``stacks`` frame (same ``reason`` and ``request_id``) where a Flight Recorder exists.
    The per-group entry bound (:data:`MAX_COLLECTIVE_ENTRIES`) relates two fields, so
    :func:`check_collectives` applies it after decoding."""

    reason: Literal["stall", "request"]
    taken_at: float
    request_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID)] = ""
    groups: Annotated[list[ProcessGroupStatus], Meta(max_length=MAX_COLLECTIVE_GROUPS)] = []
    entries: Annotated[list[CollectiveEntry],
                       Meta(max_length=MAX_COLLECTIVE_GROUPS * MAX_COLLECTIVE_ENTRIES)] = []


Frame = Union[Register, Svg, Metadata, Hardware, Resources, Metrics, Finish, Steps, Stacks,
              Collectives]

#: Shared codecs. msgspec encoders/decoders are cheap to call and costly to build.
encoder = msgspec.msgpack.Encoder()
decoder: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)


class LimitExceeded(ValueError):
    """A decoded frame is over one of the byte-size limits of PROTOCOL.md section 2."""

    #: the broker's reject counter key
    reason = "limit"


class BadSteps(LimitExceeded):
    """A ``steps`` frame whose lists disagree in length or whose steps do not increase."""

    reason = "steps_shape"


def check_steps(frame: Steps) -> None:
    """Raise :class:`BadSteps` unless every list present has ``len(steps)`` entries and the
    steps are strictly increasing.

    Plain loops, not ``any(map(...))``/``all(map(...))``: for the few names and points most
    frames carry, building and driving those iterators cost more than the loop (this check
    was a seventh of the broker's instructions per 3-point frame, issue 17); only a long
    ``steps`` list takes the C-level pass."""
    steps = frame.steps
    n = len(steps)
    if len(frame.times) != n or len(frame.step_ms) != n:
        raise BadSteps("steps: times/step_ms length differs from steps")
    if (frame.samples and len(frame.samples) != n) or (frame.tokens and len(frame.tokens) != n):
        raise BadSteps("steps: samples/tokens length differs from steps")
    if frame.data_ms and len(frame.data_ms) != n:
        raise BadSteps("steps: data_ms length differs from steps")
    for values in frame.metrics.values():
        if len(values) != n:
            name = next(k for k, v in frame.metrics.items() if len(v) != n)
            raise BadSteps(f"steps: metric {name[:40]!r} length differs from steps")
    if n > _SHORT_STEPS:
        if not all(map(_lt, steps, steps[1:])):  # C-level: no bytecode per step
            raise BadSteps("steps: not strictly increasing")
    else:
        prev = -1  # (steps are >= 0)
        for step in steps:
            if step <= prev:
                raise BadSteps("steps: not strictly increasing")
            prev = step


class BadCollectives(LimitExceeded):
    """A ``collectives`` frame with more than 64 entries of one group (section 7.2)."""

    reason = "schema"


def check_collectives(frame: Collectives) -> None:
    """Raise :class:`BadCollectives` when one group has more than
    :data:`MAX_COLLECTIVE_ENTRIES` entries (the list's own bound is 64 x 64)."""
    entries = frame.entries
    if len(entries) <= MAX_COLLECTIVE_ENTRIES:
        return
    counts: dict[str, int] = {}
    for entry in entries:
        n = counts[entry.pg] = counts.get(entry.pg, 0) + 1
        if n > MAX_COLLECTIVE_ENTRIES:
            raise BadCollectives(f"collectives: over {MAX_COLLECTIVE_ENTRIES} entries of "
                                 f"group {entry.pg[:40]!r}")


#: Up to this many steps a frame's order is checked by a loop (cheaper than the C-level
#: pass's set-up), beyond it by ``all(map(lt, ...))``.
_SHORT_STEPS = 8


def utf8_over(text: str, limit: int) -> bool:
    """True when ``text`` is more than ``limit`` UTF-8 bytes, encoding only when it must."""
    n = len(text)
    if n * 4 <= limit:  # every code point is at most 4 bytes
        return False
    if n > limit:
        return True
    return len(text.encode("utf-8", "surrogatepass")) > limit


def _check_svg(frame: Svg) -> None:
    if utf8_over(frame.svg, MAX_SVG_BYTES):
        raise LimitExceeded("svg over 2 MiB")


def _check_metadata(frame: Metadata) -> None:
    if utf8_over(frame.json, MAX_METADATA_BYTES):
        raise LimitExceeded("metadata json over 1 MiB")


#: The after-decode check of each frame type that has one (one dict lookup per frame; the
#: frames that are nearly all the traffic, resources and metrics, have none).
_CHECKS: dict[type, Callable[[Any], None]] = {
    Steps: check_steps, Svg: _check_svg, Metadata: _check_metadata,
    Collectives: check_collectives,
}
_decode = decoder.decode
#: The after-decode check of a frame type, or None: ``decode`` is ``decoder.decode`` then
#: this (the broker's receive path inlines the two, one call fewer per frame).
check_of = _check_of = _CHECKS.get


def check_limits(frame: Frame) -> None:
    """Raise :class:`LimitExceeded` for the limits msgspec constraints cannot express."""
    check = _check_of(type(frame))
    if check is not None:
        check(frame)


def decode(data: bytes | memoryview) -> Frame:
    """Decode and fully validate one frame.

    Raises ``msgspec.DecodeError`` (not MessagePack), ``msgspec.ValidationError``
    (wrong shape, type, tag or constraint) or :class:`LimitExceeded`.
    """
    frame = _decode(data)
    check = _check_of(type(frame))
    if check is not None:
        check(frame)
    return frame

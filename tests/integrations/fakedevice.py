"""A fake accelerator for counting device synchronisations: tensors that live "on the
device" (``device.type == "cuda"``), a stream that finishes queued work only when the test
says so, host copies that must not be read before their copy finished, and events.

Every call that makes the host wait for the device is counted in ``Stream.syncs``: ``.item()``
or ``float()`` of a device tensor, a blocking ``.to("cpu")``, ``Event.synchronize()``. The
integrations promise none of these per step."""
from __future__ import annotations

from typing import Any


class Device:
    type = "cuda"
    index = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device)

    def __hash__(self) -> int:
        return hash("fake-cuda")

    def __repr__(self) -> str:
        return "device(type='cuda', index=0)"


class HostDevice:
    type = "cpu"


class Stream:
    """Work is numbered in issue order; ``done`` is how far the device has got."""

    def __init__(self) -> None:
        self.issued = 0
        self.done = 0
        self.syncs = 0
        self.ops = 0  # kernels and copies issued (cost, not syncs)

    def issue(self) -> int:
        self.issued += 1
        self.ops += 1
        return self.issued

    def advance(self, n: int = 1) -> None:
        """The device finishes ``n`` more queued operations."""
        self.done = min(self.issued, self.done + n)

    def finish_all(self) -> None:
        self.done = self.issued

    def wait(self, pos: int) -> None:
        """The host blocks until work ``pos`` is done: a synchronisation."""
        self.syncs += 1
        self.done = max(self.done, pos)


class Tensor:
    """A one-element tensor on the fake device, produced by work item ``pos``."""

    device = Device()

    def __init__(self, stream: Stream, value: float) -> None:
        self.stream = stream
        self.value = float(value)
        self.pos = stream.issue()

    def numel(self) -> int:
        return 1

    def detach(self) -> Tensor:
        return self

    def item(self) -> float:
        self.stream.wait(self.pos)
        return self.value

    def __float__(self) -> float:
        return self.item()

    def to(self, where: Any, non_blocking: bool = False) -> HostTensor:
        assert str(where) == "cpu", where
        host = HostTensor(self.stream, self.value, self.stream.issue())
        if not non_blocking:
            self.stream.wait(host.pos)
        return host

    def float(self) -> Tensor:
        return self

    def clone(self) -> Tensor:
        return Tensor(self.stream, self.value)

    def add_(self, other: Any) -> Tensor:
        self.value += other.value if isinstance(other, Tensor) else float(other)
        self.pos = self.stream.issue()
        return self


class HostTensor:
    """Pinned host memory an asynchronous copy writes; reading it early would be garbage."""

    device = HostDevice()

    def __init__(self, stream: Stream, value: float, pos: int) -> None:
        self.stream = stream
        self.value = value
        self.pos = pos

    def numel(self) -> int:
        return 1

    def item(self) -> float:
        assert self.stream.done >= self.pos, "host copy read before the device wrote it"
        return self.value


class Event:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.pos = 0

    def record(self) -> None:
        self.pos = self.stream.issued

    def query(self) -> bool:
        return self.stream.done >= self.pos

    def synchronize(self) -> None:
        if not self.query():
            self.stream.wait(self.pos)

"""The agent's frames as a receiver sees them: real PUSH -> PULL over loopback, decoded with
the shared wire schema (so every frame also passes the broker's constraints)."""
from __future__ import annotations

import contextlib
import math
import os

import pytest

from rank_agent import RankAgent
from rank_agent.protocol import (
    Finish,
    Hardware,
    Metadata,
    Metrics,
    Register,
    Resources,
    Svg,
)


def test_every_frame_type_round_trips(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, run="job-42", rank=1, world_size=4, local_rank=1, host="node-a")
    assert agent.register(port=8600, total_epochs=10)
    assert agent.set_svg("<svg xmlns='http://www.w3.org/2000/svg'/>", label="resnet", hash="abc123")
    assert agent.set_metadata({"lr": 0.1, "layers": [1, 2]})
    assert agent.set_hardware("Xeon (8 threads, 64 GB) | H100 (80 GB)")
    assert agent.log_epoch(0, 0.75, batches=10, samples=320, epoch_ms=1500.0,
                           scalars={"acc": 0.5, "grad_norm": (6.0, 3)}, share_complete_ms=1400.0)
    assert agent.finish("ok")
    frames = receiver.wait_count(6)
    reg, svg, meta, hw, met, fin = frames
    assert isinstance(reg, Register)
    assert (reg.run, reg.rank, reg.world_size, reg.local_rank, reg.host) == ("job-42", 1, 4, 1, "node-a")
    assert (reg.port, reg.total_epochs, reg.pid) == (8600, 10, os.getpid())
    assert isinstance(svg, Svg) and svg.label == "resnet" and svg.hash == "abc123" and svg.svg.startswith("<svg")
    assert isinstance(meta, Metadata) and meta.json == '{"lr": 0.1, "layers": [1, 2]}'
    assert isinstance(hw, Hardware) and hw.summary == "Xeon (8 threads, 64 GB) | H100 (80 GB)"
    assert isinstance(met, Metrics)
    assert (met.epoch, met.avg_loss, met.batches, met.samples, met.epoch_ms) == (0, 0.75, 10, 320, 1500.0)
    assert met.share_complete_ms == 1400.0
    assert met.scalars == {"acc": (0.5, 1), "grad_norm": (6.0, 3)}
    assert met.resources is None  # no sampler running
    assert isinstance(fin, Finish) and fin.status == "ok"
    assert all(f.run == "job-42" and f.rank == 1 for f in frames)
    assert agent.sent == 6 and agent.dropped == 0 and agent.errors == 0


def test_sampler_sends_resources_and_log_epoch_attaches_the_latest(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    agent.start_sampling(interval=0.1)
    agent.start_sampling(interval=0.1)  # a second call is a no-op, not a second thread
    frames = receiver.wait_for(lambda fs: sum(isinstance(f, Resources) for f in fs) >= 2)
    res = [f for f in frames if isinstance(f, Resources)]
    sample = res[-1].sample
    assert sample.ram_total_bytes and 0 < sample.ram_used_bytes <= sample.ram_total_bytes
    assert sample.cpu_percent is not None and 0.0 <= sample.cpu_percent <= 100.0
    assert agent.latest_sample is not None
    agent.log_epoch(3, 1.0, batches=1)
    met = receiver.wait_for(lambda fs: any(isinstance(f, Metrics) for f in fs))
    met = receiver.of_type(Metrics)[0]
    assert met.epoch == 3 and met.resources is not None and met.resources.ram_total_bytes == sample.ram_total_bytes
    threads = [t for t in __import__("threading").enumerate() if t.name.startswith("rankboard-sampler")]
    assert len(threads) == 1 and threads[0].daemon
    agent.close()
    assert not threads[0].is_alive()


def test_default_hardware_summary_is_detected(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    assert agent.set_hardware()
    (hw,) = receiver.wait_count(1)
    assert isinstance(hw, Hardware)
    cpu = hw.summary.split(" | ")[0]
    assert f"({os.cpu_count()} threads, " in cpu and cpu.endswith(" GB)")


def test_strings_are_clamped_and_run_ids_sanitised(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, run="my job/step #3" + "x" * 200, host="h" * 300)
    assert len(agent.run) == 128
    agent.register(total_epochs=1)
    agent.set_svg("<svg/>", label="l" * 300, hash="#" * 300)
    agent.set_hardware("s" * 5000)
    agent.log_epoch(0, 1.0, scalars={"n" * 200: 1.0})
    reg, svg, hw, met = receiver.wait_count(4)
    assert reg.run == agent.run and reg.run.startswith("my_job_step_3xxx")
    assert len(reg.host) == 256
    assert len(svg.label) == 256 and len(svg.hash) == 256
    assert len(hw.summary) == 4096
    assert list(met.scalars) == ["n" * 128]


def test_metadata_forms(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    assert agent.set_metadata('{"a": 1}')
    assert agent.set_metadata(b'[1, 2]')
    assert agent.set_metadata({"loss": math.nan, "best": [math.inf, 1.0]})
    a, b, c = receiver.wait_count(3)
    assert (a.json, b.json) == ('{"a": 1}', "[1, 2]")
    assert c.json == '{"loss": null, "best": [null, 1.0]}'


def test_unserialisable_or_invalid_metadata_is_skipped_and_logged_once(receiver, make_agent, caplog):
    agent = make_agent(broker=receiver.endpoint)
    caplog.set_level("WARNING", logger="rank_agent")
    assert agent.set_metadata({"model": object()}) is False
    assert agent.set_metadata({"model": object()}) is False
    assert agent.set_metadata("{not json") is False
    assert agent.errors == 3 and agent.dropped == 3 and agent.sent == 0
    warnings = [r for r in caplog.records if r.name == "rank_agent.agent"]
    assert len(warnings) == 1 and "metadata" in warnings[0].getMessage()
    assert agent.set_metadata({"ok": True})  # the agent is still fine
    (meta,) = receiver.wait_count(1)
    assert meta.json == '{"ok": true}'


def test_bad_values_never_raise_and_never_reach_the_wire(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    assert agent.log_epoch(-1, 1.0) is False
    assert agent.log_epoch(0, None) is False  # type: ignore[arg-type]
    assert agent.log_epoch(0, 1.0, scalars={"x": (1.0, -2)}) is False
    assert agent.log_epoch(0, 1.0, batches=-5) is False
    assert agent.set_svg("x" * (2 * 1024 * 1024 + 1)) is False
    assert agent.register(port=70000, total_epochs=1)  # out-of-range port: registered without one
    assert agent.log_epoch(1, math.nan, scalars={"n": (math.inf, 1)})  # non-finite is legal
    assert agent.errors == 5
    reg, met = receiver.wait_count(2)
    assert reg.port == 0 and reg.total_epochs == 1
    assert met.epoch == 1 and math.isnan(met.avg_loss) and met.scalars["n"][0] == math.inf


def test_numbers_from_numpy_like_objects_are_accepted(receiver, make_agent):
    class Scalar:  # what a 0-d tensor or numpy scalar offers
        def __init__(self, v):
            self.v = v

        def __float__(self):
            return float(self.v)

        def __index__(self):
            return int(self.v)

        def __int__(self):
            return int(self.v)

    agent = make_agent(broker=receiver.endpoint)
    assert agent.log_epoch(Scalar(2), Scalar(0.25), batches=Scalar(4), scalars={"acc": Scalar(0.5)})
    (met,) = receiver.wait_count(1)
    assert (met.epoch, met.avg_loss, met.batches, met.scalars) == (2, 0.25, 4, {"acc": (0.5, 1)})


def test_values_of_other_types_are_converted_as_float_and_int_would(receiver, make_agent):
    """log_epoch's fast path (exact float/int/tuple/str used as they are) must not change what
    other types become: subclasses, bools, ints for floats, lists, non-str names."""
    from types import MappingProxyType

    class F(float):  # numpy.float64 is a float subclass
        pass

    class I(int):  # noqa: E742 - numpy integer-like
        pass

    agent = make_agent(broker=receiver.endpoint)
    assert agent.log_epoch(I(3), F(0.5), batches=True, samples=I(7), epoch_ms=2,
                           share_complete_ms=I(5),
                           scalars={"f": F(1.5), "i": 2, "b": True, "l": [I(4), F(2.0)],
                                    "t": (3, I(2)), 7: 0.25, "n" * 130: (1.0, 1)})
    assert agent.log_epoch(4, 1.0, scalars=MappingProxyType({f"s{i}": 1.0 for i in range(300)}))
    assert agent.log_epoch(5, 1.0, scalars={"l": [1.0]}) is False  # a pair needs two items
    assert agent.log_epoch(6, 1.0, scalars={"x": "1.5"})  # float("1.5"), as before
    a, b, c = receiver.wait_count(3)
    assert (a.epoch, a.avg_loss, a.batches, a.samples, a.epoch_ms, a.share_complete_ms) == (
        3, 0.5, 1, 7, 2.0, 5.0)
    assert a.scalars == {"f": (1.5, 1), "i": (2.0, 1), "b": (1.0, 1), "l": (4.0, 2),
                         "t": (3.0, 2), "7": (0.25, 1), "n" * 128: (1.0, 1)}
    for pair in a.scalars.values():
        assert type(pair[0]) is float and type(pair[1]) is int
    assert len(b.scalars) == 256 and list(b.scalars)[-1] == "s255"
    assert c.scalars == {"x": (1.5, 1)}
    assert agent.errors == 1 and agent.sent == 3 + 1  # + the implicit register


def test_too_many_scalars_are_capped(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    assert agent.log_epoch(0, 1.0, scalars={f"s{i}": float(i) for i in range(300)})
    (met,) = receiver.wait_count(1)
    assert len(met.scalars) == 256


@pytest.mark.parametrize(
    ("exc", "expected"),
    [(None, "ok"), (RuntimeError, "error"), (KeyboardInterrupt, "error"), (SystemExit, "ok")],
)
def test_context_manager_finishes_then_closes(receiver, exc, expected):
    agent = RankAgent(broker=receiver.endpoint, run="cm", rank=0, world_size=1, linger_ms=200)
    with pytest.raises(exc) if exc else contextlib.nullcontext():
        with agent:
            agent.log_epoch(0, 1.0)
            if exc:
                raise exc()
    assert agent.closed
    met, fin = receiver.wait_count(2)
    assert isinstance(fin, Finish) and fin.status == expected


def test_context_manager_does_not_repeat_an_explicit_finish(receiver):
    with RankAgent(broker=receiver.endpoint, run="cm", rank=0, world_size=1, linger_ms=200) as agent:
        agent.finish("error")
    (fin,) = receiver.wait_count(1)
    assert fin.status == "error"
    assert agent.sent == 1 + 1  # + the implicit register


def test_finish_status_is_ok_or_error(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    agent.finish("weird")
    (fin,) = receiver.wait_count(1)
    assert fin.status == "error"


def test_frames_after_close_are_dropped(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    agent.close()
    agent.close()  # idempotent
    assert agent.log_epoch(0, 1.0) is False
    assert agent.dropped == 1 and agent.errors == 0


def test_constructor_does_no_io_and_rejects_impossible_ranks():
    import zmq

    before = zmq.Context._instance  # the agent never uses the global instance either
    agent = RankAgent(broker="tcp://127.0.0.1:1", run="r", rank=0, world_size=1)
    assert agent._pusher._ctx is None and agent._pusher._sock is None
    agent.close()
    assert zmq.Context._instance is before
    for kwargs in ({"rank": 2, "world_size": 2}, {"rank": -1, "world_size": 2},
                   {"rank": 0, "world_size": 0}, {"rank": 0, "world_size": 2, "local_rank": -1}):
        with pytest.raises(ValueError):
            RankAgent(broker="tcp://127.0.0.1:1", run="r", **kwargs)


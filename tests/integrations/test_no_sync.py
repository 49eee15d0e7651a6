"""No device synchronisation per step: the integrations hand GPU values to ``log_step``
without ``.item()``. Counted with a fake accelerator (tests/integrations/fakedevice.py) whose
stream finishes work only when the test says so and which counts every host wait."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest
import torch

from rank_agent.integrations._common import Reporter, StepPipeline, Sum, classify
from tests.integrations import fakedevice as fd


class StubAgent:
    """What Reporter calls on a RankAgent, recorded."""

    rank = 0
    run = "stub"

    def __init__(self) -> None:
        self.steps: List[Tuple[int, Dict[str, Any], int, int]] = []
        self.epochs: List[Dict[str, Any]] = []
        self.finished: List[str] = []
        self.closed = False

    def log_step(self, step: int, metrics: Any = None, samples: int = 0, tokens: int = 0) -> bool:
        self.steps.append((step, dict(metrics or {}), samples, tokens))
        return True

    def log_epoch(self, epoch: int, avg_loss: float, **kw: Any) -> bool:
        self.epochs.append({"epoch": epoch, "avg_loss": avg_loss, **kw})
        return True

    def finish(self, status: str = "ok", error: Any = None) -> bool:
        self.finished.append(status)
        return True

    def close(self) -> None:
        self.closed = True


def lagging_device(stream: fd.Stream, lag: int) -> Any:
    """Returns ``after_push(step)``: the device is ``lag`` steps behind the host."""
    marks: Dict[int, int] = {}

    def after_push(step: int) -> None:
        marks[step] = stream.issued
        if step - lag in marks:
            stream.done = max(stream.done, marks[step - lag])
    return after_push


def test_pipeline_sends_one_step_per_step_and_never_waits_for_the_device() -> None:
    stream = fd.Stream()
    sent: List[Tuple[Any, ...]] = []
    pipe = StepPipeline(lambda *a: sent.append(a), event_factory=lambda d: fd.Event(stream))
    after_push = lagging_device(stream, lag=3)
    per_push = []
    for step in range(1, 101):
        loss = fd.Tensor(stream, step * 0.5)  # the step's work produces the loss
        before = len(sent)
        pipe.push(step, {"loss": loss, "lr": 0.1, "flag": True, "name": "x"}, samples=8)
        per_push.append(len(sent) - before)
        after_push(step)
    assert stream.syncs == 0, "a step waited for the device"
    # the device is 3 steps behind: from then on, exactly one point per step, no bursts
    assert per_push[:4] == [0, 0, 0, 0]
    assert per_push[4:] == [1] * 96
    assert pipe.pending == 4
    pipe.drain()  # end of training: one wait, then everything
    assert stream.syncs == 1
    assert [s[0] for s in sent] == list(range(1, 101))
    for step, metrics, samples, tokens in sent:
        assert metrics == {"loss": step * 0.5, "lr": 0.1}  # bools and strings are not metrics
        assert (samples, tokens) == (8, 0)


def test_pipeline_with_numbers_only_sends_at_once() -> None:
    sent: List[Tuple[Any, ...]] = []
    pipe = StepPipeline(lambda *a: sent.append(a), event_factory=lambda d: pytest.fail("event"))
    pipe.push(1, {"loss": 2.0, "cpu": torch.tensor(3.0), "np": torch.tensor(4).numpy()[()]})
    assert sent == [(1, {"loss": 2.0, "cpu": 3.0, "np": 4}, 0, 0)]
    assert pipe.pending == 0


def test_a_stalled_device_backs_up_then_bursts_past_max_lag_without_waiting() -> None:
    stream = fd.Stream()
    sent: List[Tuple[Any, ...]] = []
    pipe = StepPipeline(lambda *a: sent.append(a), max_lag=8, hard_cap=64,
                        event_factory=lambda d: fd.Event(stream))
    for step in range(1, 21):  # the device is stuck (a long kernel): nothing finishes
        pipe.push(step, {"loss": fd.Tensor(stream, step)})
    assert sent == [] and pipe.pending == 20 and stream.syncs == 0
    stream.finish_all()
    pipe.push(21, {"loss": fd.Tensor(stream, 21)})  # 21 waiting > max_lag: all finished go
    assert [s[0] for s in sent] == list(range(1, 21))
    assert stream.syncs == 0
    assert pipe.forced_syncs == 0


def test_hard_cap_bounds_the_backlog_of_a_device_that_never_finishes() -> None:
    stream = fd.Stream()
    pipe = StepPipeline(lambda *a: None, max_lag=4, hard_cap=16,
                        event_factory=lambda d: fd.Event(stream))
    for step in range(1, 101):
        pipe.push(step, {"loss": fd.Tensor(stream, step)})
        assert pipe.pending <= 17
    assert pipe.forced_syncs > 0  # the bound costs waits, but only past hard_cap


def test_sum_reads_the_device_once_when_taken() -> None:
    stream = fd.Stream()
    total = Sum()
    for i in range(50):
        total.add(fd.Tensor(stream, 1.0 + i))
    assert stream.syncs == 0
    assert total.count == 50
    assert total.take() == sum(1.0 + i for i in range(50))
    assert stream.syncs == 1


def test_classify() -> None:
    stream = fd.Stream()
    assert classify(1.5) == (1.5, None)
    assert classify(True) == (None, None)
    assert classify(torch.tensor(2.5)) == (2.5, None)
    assert classify(torch.tensor([1.0, 2.0])) == (None, None)
    assert classify(torch.tensor(True)) == (None, None)
    dev = fd.Tensor(stream, 3.0)
    assert classify(dev) == (None, dev)
    assert stream.syncs == 0


def fake_trainer(**kw: Any) -> SimpleNamespace:
    base = dict(global_step=0, _results=None, accumulate_grad_batches=1, current_epoch=0,
                callback_metrics={})
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback_steps_cost_no_sync_and_an_epoch_one(accumulate: int) -> None:
    from rank_agent.integrations.lightning import RankboardCallback

    stream = fd.Stream()
    agent = StubAgent()
    cb = RankboardCallback()
    cb.reporter = Reporter(agent, event_factory=lambda d: fd.Event(stream))  # type: ignore[arg-type]
    trainer = fake_trainer(accumulate_grad_batches=accumulate)
    cb._last_step = trainer.global_step  # what on_fit_start records
    after_push = lagging_device(stream, lag=2)
    cb.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    batches = 40
    for batch_idx in range(batches):
        loss = fd.Tensor(stream, (batch_idx + 1) / accumulate)  # Lightning divides by k
        if (batch_idx + 1) % accumulate == 0:
            trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, {"loss": loss},  # type: ignore[arg-type]
                              torch.zeros(4, 3), batch_idx)
        after_push(trainer.global_step)
    assert stream.syncs == 0, f"{stream.syncs} syncs in {batches} batches"
    cb.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert stream.syncs == 1  # the epoch's loss sum, read once
    (epoch,) = agent.epochs
    assert epoch["batches"] == batches and epoch["samples"] == 4 * batches
    assert epoch["avg_loss"] == pytest.approx(sum(range(1, batches + 1)) / batches)
    cb.on_fit_end(trainer, None)  # type: ignore[arg-type]
    assert stream.syncs <= 2  # draining the last steps at the end waits once at most
    assert agent.finished == ["ok"] and agent.closed
    steps = batches // accumulate
    assert [s[0] for s in agent.steps] == list(range(1, steps + 1))
    for step, metrics, samples, _ in agent.steps:
        # the step loss is the mean over its accumulated batches
        expect = sum(range((step - 1) * accumulate + 1, step * accumulate + 1)) / accumulate
        assert metrics["loss"] == pytest.approx(expect)
        assert samples == 4 * accumulate


def test_accelerate_tracker_logs_device_values_without_a_sync() -> None:
    from rank_agent.integrations.accelerate import RankboardTracker

    stream = fd.Stream()
    agent = StubAgent()
    tracker = RankboardTracker(run="t", sample_interval=None, broker="tcp://127.0.0.1:1",
                               linger_ms=0)
    assert tracker.reporter is not None
    tracker.reporter.end("ok")  # the constructor's real agent: this test drives a stub instead
    tracker.reporter = Reporter(agent, event_factory=lambda d: fd.Event(stream))  # type: ignore[arg-type]
    tracker._started = True  # init_trackers' start (metadata) is not what this test is about
    after_push = lagging_device(stream, lag=1)
    for step in range(1, 31):
        tracker.log({"loss": fd.Tensor(stream, step), "lr": 0.5, "note": "text"}, step=step)
        after_push(step)
    assert stream.syncs == 0
    tracker.finish()
    assert stream.syncs <= 1
    assert [s[0] for s in agent.steps] == list(range(1, 31))
    assert all(m == {"loss": float(s), "lr": 0.5} for s, m, _, _ in agent.steps)
    assert agent.finished == ["ok"]


def test_trainer_callback_sends_a_step_only_with_the_numbers_logged_after_its_end() -> None:
    """The Trainer calls on_log for a step after on_step_end (and once more after
    on_epoch_end): the step's one point must carry them. Sent at on_step_end, every rank's
    point could reach the broker first and close the step; the loss would arrive late and be
    dropped (seen in CI: a step with no loss)."""
    from rank_agent.integrations.transformers import RankboardCallback

    agent = StubAgent()
    cb = RankboardCallback()
    cb.reporter = Reporter(agent)  # type: ignore[arg-type]
    cb._samples_per_step, cb._world, cb._rank, cb._tokens_seen = 4, 1, 0, 0
    args = SimpleNamespace()
    for step in (1, 2, 3):
        state = SimpleNamespace(global_step=step, epoch=1.0, num_input_tokens_seen=0)
        cb.on_step_end(args, state, None)
        assert [s[0] for s in agent.steps] == list(range(1, step))  # nothing of this step yet
        cb.on_log(args, state, None, logs={"loss": 1.0 / step, "learning_rate": 0.1})
    cb.on_log(args, state, None, logs={"grad_norm": 2.0})  # after on_epoch_end, same step
    cb.reporter.end("ok")
    assert [(s, m, n) for s, m, n, _ in agent.steps] == [
        (1, {"loss": 1.0, "learning_rate": 0.1}, 4),
        (2, {"loss": 0.5, "learning_rate": 0.1}, 4),
        (3, {"loss": 1.0 / 3, "learning_rate": 0.1, "grad_norm": 2.0}, 4),
    ]
    assert agent.finished == ["ok"]

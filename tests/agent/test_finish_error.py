"""Why a rank ended (PROTOCOL 8.2), from the agent's side: ``finish(error=exc)``, the ``with``
block's exception, and the exit rule (an unfinished agent finishes at interpreter exit,
``error`` with the main thread's uncaught exception, ``ok`` otherwise), in real processes
talking to a real PULL socket; a forked child never finishes its parent's rank; a killed
process sends nothing. The wire bounds of ``ErrorInfo`` and the agent's cutting to fit them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import msgspec
import pytest

from rank_agent import RankAgent
from rank_agent.errorinfo import error_info, type_name
from rank_agent.protocol import (
    MAX_ERROR_FRAMES,
    MAX_ERROR_MESSAGE,
    ErrorInfo,
    Finish,
    StackFrame,
    decode,
    encoder,
)
from tests.support import REPO
from tests.support.agent import Receiver


class ShardError(Exception):
    pass


def run_script(receiver: Receiver, body: str, run: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter with ``agent`` built for ``run`` (no finish, no
    close: whatever the script does after is what the test is about)."""
    code = (f"from rank_agent import RankAgent\n"
            f"agent = RankAgent(broker={receiver.endpoint!r}, run={run!r}, rank=0, world_size=1)\n"
            f"agent.register()\n" + textwrap.dedent(body))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def finishes(receiver: Receiver, n: int = 1) -> list[Finish]:
    receiver.wait_for(lambda fs: sum(isinstance(f, Finish) for f in fs) >= n, timeout=20)
    return receiver.of_type(Finish)


# -- the wire ------------------------------------------------------------------------------

def finish_bytes(**error: Any) -> bytes:
    info = {"type": "RuntimeError", "message": "boom", "at": 1.0, **error}
    return msgspec.msgpack.encode({"type": "finish", "run": "r", "rank": 0, "status": "error",
                                   "error": info})


@pytest.mark.parametrize("error", [
    {"type": "T" * 257},
    {"message": "m" * (MAX_ERROR_MESSAGE + 1)},
    {"frames": [{"file": "f", "line": 1, "function": "g"}] * (MAX_ERROR_FRAMES + 1)},
    {"frames": [{"file": "f" * 513, "line": 1, "function": "g"}]},
    {"at": "soon"},
])
def test_an_error_over_a_bound_is_a_schema_rejection(error: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(finish_bytes(**error))


def test_an_error_at_the_bounds_decodes() -> None:
    frame = decode(finish_bytes(type="T" * 256, message="m" * MAX_ERROR_MESSAGE,
                                frames=[{"file": "f" * 512, "line": 3, "function": "g",
                                         "code": "c" * 512}] * MAX_ERROR_FRAMES))
    assert isinstance(frame, Finish) and frame.error is not None
    assert len(frame.error.frames) == MAX_ERROR_FRAMES


def test_a_finish_without_error_is_the_v4_frame() -> None:
    assert decode(encoder.encode(Finish(run="r", rank=0))) == Finish(run="r", rank=0)
    wire = msgspec.msgpack.decode(encoder.encode(Finish(run="r", rank=0, status="error")))
    assert "error" not in wire  # omitted: a v4 broker reads the same frame


# -- building an ErrorInfo -----------------------------------------------------------------

def recurse(n: int) -> None:
    if n == 0:
        raise ShardError("x" * 10_000)
    recurse(n - 1)


def test_the_agent_cuts_the_message_and_keeps_the_innermost_frames() -> None:
    try:
        recurse(200)
    except ShardError as exc:
        info = error_info(exc, at=12.5)
    assert info.type == f"{__name__}.ShardError" and info.at == 12.5
    assert info.message == "x" * MAX_ERROR_MESSAGE
    assert len(info.frames) == MAX_ERROR_FRAMES
    assert info.frames[-1] == StackFrame(file=__file__, line=info.frames[-1].line,
                                         function="recurse",
                                         code='raise ShardError("x" * 10_000)')
    decode(encoder.encode(Finish(run="r", rank=0, status="error", error=info)))  # fits


def test_type_names_leave_builtins_out_and_keep_qualnames() -> None:
    class Inner(ValueError):
        pass

    assert type_name(RuntimeError) == "RuntimeError"
    assert type_name(Inner) == (f"{__name__}.test_type_names_leave_builtins_out_and_keep_"
                                "qualnames.<locals>.Inner")
    assert type_name(msgspec.ValidationError) == "msgspec.ValidationError"


def test_an_exception_that_cannot_be_printed_still_makes_an_error() -> None:
    class Hostile(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

        def __repr__(self) -> str:
            raise RuntimeError("no")

    info = error_info(Hostile(), at=float("nan"))
    assert info.type.endswith("Hostile") and info.message == "<unprintable exception>"
    assert info.at > 1e9  # a non-finite time is now


# -- in this process -----------------------------------------------------------------------

def test_finish_takes_an_exception(receiver: Receiver, make_agent: Any) -> None:
    agent = make_agent(broker=receiver.endpoint, run="fin-exc")
    t0 = time.time()
    try:
        raise ShardError("bad shard 17\nsecond line")
    except ShardError as exc:
        assert agent.finish(error=exc) is True  # status "ok" by default: the error wins
    (fin,) = finishes(receiver)
    assert fin.status == "error" and fin.error is not None
    assert fin.error.type == f"{__name__}.ShardError"
    assert fin.error.message == "bad shard 17\nsecond line"
    assert t0 <= fin.error.at <= time.time()
    assert fin.error.frames[-1].function == "test_finish_takes_an_exception"


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (KeyboardInterrupt(), "error", "KeyboardInterrupt"),
    (SystemExit(3), "error", "SystemExit"),
    (SystemExit(0), "ok", None),
    (SystemExit(None), "ok", None),
    (MemoryError("oom"), "error", "MemoryError"),
])
def test_the_with_block_sends_its_exception(receiver: Receiver, exc: BaseException,
                                            status: str, kind: str | None) -> None:
    with pytest.raises(type(exc)):
        with RankAgent(broker=receiver.endpoint, run="with-exc", rank=0, world_size=1):
            raise exc
    (fin,) = finishes(receiver)
    assert fin.status == status
    assert (fin.error.type if fin.error is not None else None) == kind


def test_close_finishes_an_unfinished_agent_ok(receiver: Receiver) -> None:
    agent = RankAgent(broker=receiver.endpoint, run="close-ok", rank=0, world_size=1)
    agent.register()
    agent.close()
    (fin,) = finishes(receiver)
    assert fin.status == "ok" and fin.error is None


def test_a_shared_agent_sends_its_users_earliest_error(receiver: Receiver,
                                                       launcher_env: Any) -> None:
    a = RankAgent.from_env(broker=receiver.endpoint, run="shared-err")
    b = RankAgent.from_env(broker=receiver.endpoint, run="shared-err")
    assert a is b
    first = error_info(ShardError("first"), at=100.0)
    a.finish(error=error_info(ShardError("second"), at=200.0))
    b.finish(error=first)
    a.close()
    b.close()  # the last user's close sends it
    (fin,) = finishes(receiver)
    assert fin.error is not None and fin.error.message == "first"


# -- real processes: the exit rule ---------------------------------------------------------

def test_an_uncaught_exception_finishes_with_it_and_still_prints(receiver: Receiver,
                                                                 tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        def users_hook(tp, value, tb):
            print("USER HOOK RAN:", tp.__name__, file=sys.stderr)
            sys.__excepthook__(tp, value, tb)
        sys.excepthook = users_hook
        from rank_agent import RankAgent
        agent = RankAgent(broker={receiver.endpoint!r}, run="uncaught", rank=0, world_size=1)
        agent.log_epoch(0, 1.0)
        class ShardError(Exception):
            pass
        def load(shard):
            raise ShardError(f"shard {{shard}} is corrupt")
        load(17)
        """))
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 1
    assert "USER HOOK RAN: ShardError" in out.stderr
    assert "Traceback (most recent call last)" in out.stderr
    assert "ShardError: shard 17 is corrupt" in out.stderr
    fin = finishes(receiver)
    assert len(fin) == 1 and fin[0].status == "error" and fin[0].error is not None
    assert fin[0].error.type == "__main__.ShardError"
    assert fin[0].error.message == "shard 17 is corrupt"
    assert [f.function for f in fin[0].error.frames] == ["<module>", "load"]
    assert fin[0].error.frames[-1].code == 'raise ShardError(f"shard {shard} is corrupt")'


def test_a_hook_installed_after_the_agent_does_not_hide_the_exception(
        receiver: Receiver) -> None:
    out = run_script(receiver, """
        import sys
        sys.excepthook = lambda tp, value, tb: print("LATER HOOK", file=sys.stderr)
        raise ValueError("late")
        """, "later-hook")
    assert "LATER HOOK" in out.stderr
    (fin,) = finishes(receiver)
    assert fin.error is not None and (fin.error.type, fin.error.message) == ("ValueError", "late")


def test_a_normal_exit_without_finish_finishes_ok(receiver: Receiver) -> None:
    out = run_script(receiver, "agent.log_epoch(0, 1.0)\n", "exit-ok")
    assert out.returncode == 0, out.stderr
    (fin,) = finishes(receiver)
    assert fin.status == "ok" and fin.error is None


def test_sys_exit_outside_a_with_block_finishes_ok(receiver: Receiver) -> None:
    out = run_script(receiver, "import sys\nsys.exit(3)\n", "exit-3")
    assert out.returncode == 3
    (fin,) = finishes(receiver)
    assert fin.status == "ok"  # Python tells exit hooks nothing of sys.exit(n)


def test_a_killed_process_sends_no_finish(receiver: Receiver) -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from rank_agent import RankAgent
        agent = RankAgent(broker={receiver.endpoint!r}, run="killed", rank=0, world_size=1)
        agent.log_epoch(0, 1.0)
        print("ready", flush=True)
        time.sleep(60)
        """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    with proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            receiver.wait_count(1)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(20) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    deadline = time.monotonic() + 1.5  # anything still in flight would arrive by then
    while time.monotonic() < deadline:
        receiver._pump(deadline)
    assert receiver.of_type(Finish) == []


def test_a_forked_child_never_finishes_its_parents_rank(receiver: Receiver) -> None:
    out = run_script(receiver, """
        import os, sys
        agent.log_epoch(0, 1.0)
        pid = os.fork()
        if pid == 0:  # a data-loader worker: exits through the interpreter, atexit and all
            with agent:
                pass
            raise RuntimeError("worker died")
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        raise KeyError("parent")
        """, "forked")
    assert "child exit 1" in out.stdout and "worker died" in out.stderr
    (fin,) = finishes(receiver)
    deadline = time.monotonic() + 1.0  # a second finish, if any, would arrive by then
    while time.monotonic() < deadline:
        receiver._pump(deadline)
    assert receiver.of_type(Finish) == [fin]
    assert fin.error is not None and fin.error.type == "KeyError"


def test_an_error_info_is_sent_as_it_is(receiver: Receiver, make_agent: Any) -> None:
    agent = make_agent(broker=receiver.endpoint, run="as-is")
    info = ErrorInfo(type="x.Y", message="m", at=5.0)
    agent.finish("ok", error=info)
    (fin,) = finishes(receiver)
    assert fin.error == info and fin.status == "error"


def test_a_script_that_dies_before_its_agent_spoke_still_reports_it(receiver: Receiver) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from rank_agent import RankAgent
        agent = RankAgent(broker={receiver.endpoint!r}, run="early", rank=0, world_size=1)
        raise ImportError("no module named model")
        """)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "ImportError" in out.stderr
    (fin,) = finishes(receiver)
    assert fin.error is not None and fin.error.type == "ImportError"


def test_an_agent_that_never_spoke_closes_without_a_finish(receiver: Receiver) -> None:
    RankAgent(broker=receiver.endpoint, run="silent-close", rank=0, world_size=1).close()
    probe = RankAgent(broker=receiver.endpoint, run="probe", rank=0, world_size=1)
    probe.register()
    probe.close()  # its frames arrive after anything the first agent could have sent
    receiver.wait_for(lambda fs: any(f.run == "probe" and isinstance(f, Finish) for f in fs))
    assert {f.run for f in receiver.all_frames} == {"probe"}


def test_the_agent_wraps_the_excepthook_it_finds_and_always_calls_it(
        make_agent: Any, dead_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from rank_agent import lifecycle

    seen: list[Any] = []
    monkeypatch.setattr(sys, "excepthook", lambda tp, value, tb: seen.append(value))
    monkeypatch.setattr(lifecycle, "_uncaught", None)
    make_agent(broker=dead_endpoint, run="hook")
    make_agent(broker=dead_endpoint, run="hook-2")  # a second agent does not wrap its own wrapper again
    hook = sys.excepthook
    assert getattr(hook, "rankboard_wrapper", False)
    exc = ShardError("dies")
    t0 = time.time()
    hook(ShardError, exc, None)
    assert seen == [exc]  # the hook found first ran, once
    caught = lifecycle.uncaught()
    assert caught is not None and caught[0] is exc and t0 <= caught[1] <= time.time()


def test_an_interactive_session_is_not_failed_by_an_earlier_exception(
        receiver: Receiver) -> None:
    """``python -i``: an exception at the prompt ends nothing (the interpreter sets
    ``sys.last_value`` for it all the same); the session then ends normally: ``ok``."""
    code = (f"from rank_agent import RankAgent\n"
            f"agent = RankAgent(broker={receiver.endpoint!r}, run='interactive', rank=0, "
            f"world_size=1)\n"
            f"agent.register()\n")
    out = subprocess.run([sys.executable, "-i", "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, input="1 / 0\n")
    assert "ZeroDivisionError" in out.stderr
    (fin,) = finishes(receiver)
    assert fin.status == "ok" and fin.error is None

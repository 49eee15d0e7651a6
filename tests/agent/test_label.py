"""The run's readable label (PROTOCOL.md section 7.5): what the agent sends in every
register, and the default it picks (the script's name) when the caller names none."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

from rank_agent.label import resolve_label, script_label
from rank_agent.protocol import Register

REPO = Path(__file__).resolve().parents[2]


def _main(spec_name: str | None) -> types.ModuleType:
    mod = types.ModuleType("__main__")
    mod.__spec__ = types.SimpleNamespace(name=spec_name) if spec_name else None  # type: ignore[assignment]
    return mod


def test_script_label_names_the_script_the_module_or_nothing() -> None:
    assert script_label(_main(None), ["/home/me/jobs/train_gpt.py", "--lr", "1"]) == "train_gpt"
    assert script_label(_main("pkg.train"), ["/x/pkg/train.py"]) == "pkg.train"  # python -m
    assert script_label(_main("pkg.__main__"), ["/x/pkg/__main__.py"]) == "pkg"
    assert script_label(_main(None), [""]) == ""  # the interactive interpreter
    assert script_label(_main(None), ["-c"]) == ""  # python -c
    assert script_label(_main(None), []) == ""


def test_resolve_label_prefers_the_caller_then_the_framework_and_cuts_at_128() -> None:
    assert resolve_label("mine", default="framework") == "mine"
    assert resolve_label("", default="framework") == ""  # "" = no label, said explicitly
    assert resolve_label(None, default="framework") == "framework"
    assert resolve_label("é" * 300) == "é" * 128


def test_every_register_carries_the_label_the_implicit_one_too(receiver, make_agent) -> None:
    agent = make_agent(broker=receiver.endpoint, label="resnet50 lr=0.1 " + "x" * 200)
    assert agent.log_epoch(0, 1.0)  # no register() call: the implicit one goes first
    assert agent.register(total_epochs=3)
    receiver.wait_count(2)
    regs = [f for f in receiver.all_frames if isinstance(f, Register)]
    assert len(regs) == 2 and regs[0].total_epochs == 0 and regs[1].total_epochs == 3
    assert all(r.label == ("resnet50 lr=0.1 " + "x" * 200)[:128] for r in regs)


def _run_child(tmp_path: Path, endpoint: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                           "RANKBOARD_BROKER": endpoint})


def _registers(receiver) -> list[Register]:
    return [f for f in receiver.all_frames if isinstance(f, Register)]


CHILD = """
from rank_agent import RankAgent
with RankAgent.from_env(run="9f1c2a5e-uuid") as agent:
    agent.log_epoch(0, 1.0)
"""


def test_default_label_is_the_script_or_module_name_in_a_real_process(receiver, tmp_path) -> None:
    (tmp_path / "train_gpt.py").write_text(CHILD)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(CHILD)
    for argv, want in ((["train_gpt.py"], "train_gpt"), (["-m", "pkg.train"], "pkg.train"),
                       (["-c", CHILD], "")):
        before = len(_registers(receiver))
        done = _run_child(tmp_path, receiver.endpoint, argv)
        assert done.returncode == 0, done.stderr
        receiver.wait_for(lambda _, n=before: len(_registers(receiver)) > n)
        reg = _registers(receiver)[before]
        assert (reg.run, reg.label) == ("9f1c2a5e-uuid", want), argv

"""The command line a newcomer meets, as real subprocesses: a mistyped flag names the
subcommand's closest flag and its own --help; a data dir that is a file fails before any
dashboard URL is printed. One line each, exit status 2, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def rankboard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankboard", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("argv, said", [
    (["up", "--prot", "8000"], "rankboard up: unknown flag --prot (did you mean --port?); see rankboard up --help"),
    (["demo", "--rnaks", "4"], "rankboard demo: unknown flag --rnaks (did you mean --ranks?); see rankboard demo --help"),
    (["broker", "--zzz"], "rankboard broker: unknown flag --zzz; see rankboard broker --help"),
])
def test_a_mistyped_flag_names_the_closest_one_and_the_commands_help(argv: list[str], said: str) -> None:
    done = rankboard(*argv)
    assert done.returncode == 2
    assert done.stderr.strip() == said
    assert done.stdout == ""


@pytest.mark.parametrize("command", ["up", "broker", "demo"])
def test_a_data_dir_that_is_a_file_fails_before_the_dashboard_url(tmp_path: Path, command: str) -> None:
    afile = tmp_path / "state"
    afile.write_text("not a directory")
    done = rankboard(command, "--data-dir", str(afile), "--port", "0") if command != "broker" \
        else rankboard(command, "--data-dir", str(afile / "sub"))
    assert done.returncode == 2, done.stderr
    assert "http://" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().startswith(f"rankboard {command}: --data-dir ")
    assert "is a file, not a directory" in done.stderr


@pytest.mark.parametrize("argv, said", [
    # argparse's prefix matching took these as --ranks 4 and --shards 2 without a word
    (["demo", "--rank", "4"], "rankboard demo: unknown flag --rank (did you mean --ranks?); see rankboard demo --help"),
    (["up", "--shard", "2"], "rankboard up: unknown flag --shard (did you mean --shards?); see rankboard up --help"),
])
def test_a_flag_prefix_is_not_taken_for_a_longer_flag(argv: list[str], said: str) -> None:
    done = rankboard(*argv)
    assert done.returncode == 2
    assert done.stderr.strip() == said


def test_a_mistyped_command_gets_a_did_you_mean() -> None:
    done = rankboard("upp")
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line.splitlines()[-1]
    assert "invalid choice: 'upp'" in line
    assert "did you mean 'up'?" in line
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["broker", "web", "up", "demo", "keys", "export"])
def test_each_commands_help_says_what_it_does(command: str) -> None:
    done = rankboard(command, "--help")
    assert done.returncode == 0
    after_usage = done.stdout.split("\n\n", 1)[1]
    assert after_usage.startswith(f"rankboard {command}: "), done.stdout

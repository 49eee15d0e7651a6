"""RankAgent.from_env: torchrun, Slurm, bare process; run id fallbacks and sanitising."""
from __future__ import annotations

import re
import socket

import pytest

from rank_agent import RankAgent, sanitize_run_id

_LAUNCHER_VARS = (
    "RANKBOARD_BROKER", "RANKBOARD_RUN", "RANKBOARD_HOST", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID",
)
WIRE_RUN = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@pytest.fixture
def env(monkeypatch):
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_


def _agent(**kw) -> RankAgent:
    agent = RankAgent.from_env(**kw)
    agent.close()  # nothing was sent: nothing to wait for
    return agent


def test_bare_process_defaults(env):
    agent = _agent()
    assert agent.broker == "tcp://127.0.0.1:5585"
    assert (agent.rank, agent.world_size, agent.local_rank) == (0, 1, 0)
    assert agent.host == socket.gethostname()[:256]
    assert re.match(r"^run-\d{8}-\d{6}-[0-9a-f]{6}$", agent.run)


def test_torchrun(env):
    env(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="a1b2c3", RANKBOARD_BROKER="tcp://head:6000")
    agent = _agent()
    assert (agent.rank, agent.world_size, agent.local_rank, agent.run) == (5, 8, 1, "a1b2c3")
    assert agent.broker == "tcp://head:6000"


def test_torchrun_placeholder_run_id_falls_back_to_master_addr(env):
    env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="none", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert _agent().run == "10.0.0.1:29500"


def test_slurm(env):
    env(SLURM_PROCID="3", SLURM_NTASKS="16", SLURM_LOCALID="3", SLURM_JOB_ID="987654", SLURM_STEP_ID="0")
    agent = _agent()
    assert (agent.rank, agent.world_size, agent.local_rank, agent.run) == (3, 16, 3, "987654.0")


def test_slurm_without_step_and_ntasks(env):
    env(SLURM_PROCID="2", SLURM_NPROCS="4", SLURM_JOB_ID="42")
    agent = _agent()
    assert (agent.rank, agent.world_size, agent.local_rank, agent.run) == (2, 4, 0, "42")


def test_torchrun_inside_slurm_takes_ranks_from_torchrun_and_run_from_slurm(env):
    env(RANK="7", WORLD_SIZE="8", LOCAL_RANK="3", TORCHELASTIC_RUN_ID="none",
        SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID="555")
    agent = _agent()
    assert (agent.rank, agent.world_size, agent.local_rank, agent.run) == (7, 8, 3, "555")


def test_rankboard_variables_win(env):
    env(RANKBOARD_RUN="exp 1 / lr=0.1", RANKBOARD_HOST="gpu-node-7", TORCHELASTIC_RUN_ID="xyz", SLURM_JOB_ID="1")
    agent = _agent()
    assert agent.run == "exp_1_lr_0.1"
    assert agent.host == "gpu-node-7"


def test_kwargs_override_the_environment(env):
    env(RANK="1", WORLD_SIZE="2")
    agent = _agent(run="given", linger_ms=0)
    assert (agent.run, agent.rank, agent.linger_ms) == ("given", 1, 0)


def test_explicit_env_mapping(env):
    agent = _agent(env={"RANK": "0", "WORLD_SIZE": "1", "RANKBOARD_RUN": "m"})
    assert agent.run == "m"


@pytest.mark.parametrize("bad", [{"RANK": "x"}, {"RANK": "3", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "one"}])
def test_inconsistent_launcher_environment_is_a_clear_error(env, bad):
    env(**bad)
    with pytest.raises(ValueError):
        RankAgent.from_env()


@pytest.mark.parametrize(
    "raw",
    ["12345", "job[1-4]%2", "torchelastic_0f3a/attempt 2", "ünïcødé", "", "a" * 500, "x:y.z-w_v"],
)
def test_sanitize_run_id_always_matches_the_wire_pattern(raw):
    out = sanitize_run_id(raw)
    assert WIRE_RUN.match(out)
    assert sanitize_run_id(raw) == out  # deterministic: every rank lands in the same run


def test_sanitize_keeps_valid_ids_and_distinguishes_long_ones():
    assert sanitize_run_id("x:y.z-w_v") == "x:y.z-w_v"
    a, b = sanitize_run_id("a" * 200 + "1"), sanitize_run_id("a" * 200 + "2")
    assert a != b and len(a) == len(b) == 128

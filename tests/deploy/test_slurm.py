"""deploy/slurm/train.sbatch: valid bash, and what it exports makes every task a rank of
one run at the broker: the script runs with a stand-in ``srun`` that reads the environment
through ``RankAgent.from_env()`` as train.py would."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import REPO
from tests.support.deploy import DEPLOY, tool

SBATCH = DEPLOY / "slurm" / "train.sbatch"


def test_sbatch_is_valid_bash() -> None:
    bash = tool("bash", "bash")
    done = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert SBATCH.read_text().startswith("#!/bin/bash\n")
    assert "#SBATCH --ntasks-per-node" in SBATCH.read_text()


def test_sbatch_points_each_task_at_the_broker(tmp_path: Path) -> None:
    bash = tool("bash", "bash")
    fake = tmp_path / "bin"
    fake.mkdir()
    probe = ("from rank_agent import RankAgent; a = RankAgent.from_env(); "
             "print(a.broker, a.run, a.rank, a.world_size, a.local_rank)")
    (fake / "srun").write_text(f"#!/bin/sh\nexec {sys.executable} -c '{probe}'\n")
    (fake / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKBOARD_", "SLURM_"))}
    env.pop("RANK", None)
    env.update(PATH=f"{fake}{os.pathsep}{env['PATH']}", PYTHONPATH=str(REPO), HOME=str(tmp_path),
               SLURM_JOB_NAME="bert large/v2", SLURM_JOB_ID="4242", SLURM_PROCID="5",
               SLURM_NTASKS="8", SLURM_LOCALID="1")
    done = subprocess.run([bash, str(SBATCH)], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    broker, run, rank, world, local = done.stdout.strip().splitlines()[-1].split()
    assert broker == "tcp://rankboard-broker.example.org:5585"
    assert run == "bert_large_v2-4242"  # one id for the job's every rank, legal characters
    assert (rank, world, local) == ("5", "8", "1")

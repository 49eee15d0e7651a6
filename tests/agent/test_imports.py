"""Importing rank_agent inside a training process loads nothing heavy (PROTOCOL.md section 5)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import rank_agent
from rank_agent import RankAgent, Sampler
agent = RankAgent.from_env(linger_ms=0)
agent.close()
bad = {'gevent', 'flask', 'torch', 'pynvml', 'broker', 'web'} & set(sys.modules)
assert not bad, bad
assert not any(m.startswith(('zmq.green', 'gevent.', 'flask.', 'torch.')) for m in sys.modules)
print('clean')
"""


def test_import_does_not_pull_in_gevent_flask_torch_or_nvml():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_the_brief_one_liner():
    code = "import rank_agent, sys; assert not {'gevent','flask','torch'} & set(sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

"""``import rank_agent`` and ``import rank_agent.integrations`` load no framework and no torch;
each integration module loads only its own framework."""
from __future__ import annotations

import subprocess
import sys

from tests.support.integrations import REPO

HEAVY = ("torch", "lightning", "transformers", "accelerate")


def loaded_after(statement: str) -> set[str]:
    code = (f"import sys; {statement}; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_package_and_the_integrations_package_are_light() -> None:
    assert loaded_after("import rank_agent, rank_agent.integrations, "
                        "rank_agent.integrations._common") == set()


def test_each_integration_loads_its_framework_only() -> None:
    assert "lightning" in loaded_after("import rank_agent.integrations.lightning")
    assert loaded_after("import rank_agent.integrations.accelerate") & {"lightning", "transformers"} == set()
    assert "lightning" not in loaded_after("import rank_agent.integrations.transformers")

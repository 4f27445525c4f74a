"""The planner reproduces the recorded plans of a fixed corpus (``plan_corpus.py``).

Every rank plans alone, so what this interpreter plans must be what every other rank's plans:
a change here is either a deliberate change of the planner (record it: ``python
tests/plan_corpus.py --write``) or a Python, NumPy or machine on which ranks would plan apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import plan_corpus
import pytest


def test_the_corpus_plans_as_recorded() -> None:
    recorded = json.loads(plan_corpus.RECORDED.read_text())
    different = plan_corpus.differences(plan_corpus.digests(), recorded)
    assert not different, (
        "plans or fitted costs differ from tests/data/plan_corpus.json in "
        f"{', '.join(different)}: a deliberate change of the planner is recorded with "
        "`python tests/plan_corpus.py --write`; otherwise ranks on this Python or NumPy would plan "
        "unlike ranks on the recorded ones"
    )


def test_a_changed_decision_changes_the_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digests see a planner that decides differently: a slack 2.5% wider changes plans."""
    from lightning_vit_balance.solvers import tuning

    monkeypatch.setattr(tuning, "SLACK", tuning.SLACK * 1.025)
    changed = plan_corpus.differences(plan_corpus.digests(), json.loads(plan_corpus.RECORDED.read_text()))
    assert any(line.endswith(": plans") for line in changed)


def test_an_older_cpus_kernels_plan_as_recorded() -> None:
    """Ranks on nodes of another CPU generation plan alike: with NumPy's AVX2 and AVX-512 loops
    switched off and OpenBLAS's Nehalem kernels, a child process reproduces the recorded plans.
    (Costs computed with ``np.exp``/``np.log``, whose loops round differently per target, changed
    17 of the 53 groups there; the planner as it is changes none.)"""
    env = {**os.environ, **plan_corpus.older_cpu_environment()}
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        # The switch takes effect: float64 additions run the baseline loop in such a process.
        probe = "from numpy.lib.introspect import opt_func_info as f; print(f('add', 'float64'))"
        kernels = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
        assert "'current': 'baseline" in kernels.stdout, kernels.stdout + kernels.stderr
    command = [sys.executable, plan_corpus.__file__, "--planning-only"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

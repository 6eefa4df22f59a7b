"""How the CLI sets its OpenMP threads' waiting before torch loads (``infra/openmp_wait``), and that vLLM's baseline
server does not inherit it: pure functions over plain command lines and environments."""

from __future__ import annotations

import os
import subprocess
import sys

from expertmesh.bench.serve.baselines.vllm import vllm_env
from expertmesh.infra.openmp_wait import IN_PROCESS_SPINCOUNT, settings_for

SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}
SPIN = {"GOMP_SPINCOUNT": IN_PROCESS_SPINCOUNT}


def test_groups_in_the_process_spin_a_while_every_other_command_sleeps_at_once():
    assert settings_for(["up", "--groups-as", "in-process", "--port", "0"], {}) == SPIN
    assert settings_for(["bench", "serve", "--groups-as=in-process"], {}) == SPIN
    for argv in (
        ["up"],
        ["up", "--groups-as", "process"],
        ["up", "--groups-as", "ray"],
        ["group", "serve", "--model", "in-process"],  # the words, but not as the option's value
        ["up", "--groups-as"],  # no value: argparse will refuse it
        [],
    ):
        assert settings_for(argv, {}) == SLEEP, argv


def test_a_setting_in_the_environment_is_left_as_it_is():
    for environ in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": ""}):
        assert settings_for(["up", "--groups-as", "in-process"], environ) == {}
        assert settings_for(["up"], environ) == {}


def test_the_cli_applies_them_before_torch_loads():
    """A fresh interpreter: importing the CLI's entry module sets the environment, and torch is not loaded yet
    (libgomp reads the settings once, when torch loads it)."""
    script = (
        "import os, sys; sys.argv = ['expertmesh', 'up', '--groups-as', 'in-process']; "
        "import expertmesh.cli.main; "
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [IN_PROCESS_SPINCOUNT, "None", "False"]


def test_vllm_starts_without_the_settings_our_cli_added_and_with_the_users_own():
    ours = dict(SLEEP)
    env = vllm_env({"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}, 2, ours)
    assert "OMP_WAIT_POLICY" not in env and env["PATH"] == "/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["PYTHONPATH"] == ""
    # the user's own choice (a value our CLI did not add) goes to vLLM too
    env = vllm_env({"OMP_WAIT_POLICY": "ACTIVE", "VLLM_CPU_OMP_THREADS_BIND": "0"}, 2, {})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"

"""Multi-process JAX: examples/tensor_parallel_generate.py --num_processes 2 starts two local processes that join one
runtime (jax.distributed, gloo CPU collectives), shard the model over the devices of both and check the tokens
against one device. Everything runs under timeouts, so a stuck process fails the test instead of hanging it."""

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tensor_parallel_generate.py")


def launch(*flags, timeout_s=120):
    """Run the launcher (it kills its processes after timeout_s); the test's own limit is a bit longer."""
    return subprocess.run(
        [sys.executable, EXAMPLE, "--num_processes=2", "--cpu_devices=2", f"--timeout_s={timeout_s}", *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )


@pytest.mark.slow
def test_two_processes_generate_the_one_device_tokens():
    # model axis 4 over 2 devices in each process: every all-reduce crosses the process boundary.
    result = launch("--data=1", "--model=4", "--batch=2", "--prompt_tokens=5", "--max_new_tokens=3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for process in (0, 1):
        assert f"process {process} of 2: mesh {{'data': 1, 'model': 4}} over 4 devices" in result.stdout
        assert f"process {process} of 2: same tokens on one device and on the mesh" in result.stdout
        # The decode steps ran through the tensor-parallel decode_step, its collectives crossing the processes.
        assert f"process {process} of 2: decode steps ran through decode_step sharded over mesh axis 'model'" in (
            result.stdout
        )
    assert "2 processes exited with [0, 0]" in result.stdout


def test_a_failing_process_makes_the_launcher_fail():
    # 16 devices asked for, 4 exist across the two processes: each process stops with a usage error.
    result = launch("--data=4", "--model=4", timeout_s=60)
    assert result.returncode != 0
    assert "exceeds the 4 devices" in result.stderr

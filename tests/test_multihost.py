"""Multi-process JAX: examples/tensor_parallel_generate.py --num_processes 2 starts two local processes that join one
runtime (jax.distributed, gloo CPU collectives), shard the model over the devices of both and check the tokens
against one device (with "data" splitting the rows over the processes, too); a process whose coordinator never
answers stops with an error after --connect_timeout_s. Everything runs under timeouts, so a stuck process fails the
test instead of hanging it."""

import os
import socket
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


@pytest.mark.slow
def test_two_processes_split_the_rows_over_data():
    # "data" across the processes (each holds one row group): the results are gathered onto both before the check.
    # Used to exit 1: np.asarray of an array whose rows live on the other process's devices.
    result = launch("--data=2", "--model=2", "--batch=2", "--prompt_tokens=4", "--max_new_tokens=3", timeout_s=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for process in (0, 1):
        assert f"process {process} of 2: mesh {{'data': 2, 'model': 2}} over 4 devices" in result.stdout
        assert f"process {process} of 2: same tokens on one device and on the mesh" in result.stdout
        assert "rows split over 'data'" in result.stdout
    assert "2 processes exited with [0, 0]" in result.stdout


def test_a_process_without_its_coordinator_stops_in_time():
    # Nothing listens at the coordinator's port: a clear error after --connect_timeout_s (it used to wait on).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    result = subprocess.run(
        [
            sys.executable,
            EXAMPLE,
            "--num_processes=2",
            "--process_id=1",
            f"--coordinator_address={address}",
            "--connect_timeout_s=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"process 1: no coordinator at --coordinator_address={address} within --connect_timeout_s=2" in (
        result.stderr
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_a_failing_process_makes_the_launcher_fail():
    # 16 devices asked for, 4 exist across the two processes: each process stops with a usage error.
    result = launch("--data=4", "--model=4", timeout_s=60)
    assert result.returncode != 0
    assert "exceeds the 4 devices" in result.stderr

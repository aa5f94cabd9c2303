"""The example CLIs: one flag vocabulary, bad flag values as usage errors (no traceback, no work done),
generate.py on a compressed checkpoint directory and its grouped emulator profile, quickstart's rank rule."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hf_checkpoints import write_hf_checkpoint

from jax_neuronmm import compress
from jax_neuronmm.models import compress_checkpoint, generate, load_compressed_checkpoint

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def run(script, *args):
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True, timeout=600
    )


def test_generate_runs_a_compressed_checkpoint_directory(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", rank=8)
    # Used to fail with "no embedding tensor found": generate.py only knew HF directories.
    result = run("generate.py", f"--checkpoint_dir={tmp_path / 'out'}", "--prompt=w3 w11 w5 w40", "--max_new_tokens=5")
    assert result.returncode == 0, result.stderr
    model = load_compressed_checkpoint(tmp_path / "out")
    want = np.asarray(generate(model, [[3, 11, 5, 40]], 5, eos_id=model.eos_token_ids))[0, 4:]
    assert f"new ids:    {want.tolist()}" in result.stdout
    result = run("generate.py", f"--checkpoint_dir={tmp_path / 'out'}", "--keep=0.5")
    assert result.returncode != 0 and "compressed already" in result.stderr and "Traceback" not in result.stderr


def test_generate_on_the_emulator_prints_one_row_per_kernel(tmp_path):
    args = (
        "--model=llama",
        "--preset=tiny",
        "--num_layers=1",
        "--keep=0.8",
        "--backend=emulator",
        "--max_new_tokens=4",
    )
    result = run("generate.py", *args)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = [line for line in out.splitlines() if line.startswith(("svd_", "decode_step_kernel"))]
    # One row per kernel (used to be a row per launch): the fused MLP's kernels once (prefill), then the looped
    # decode-step kernel once per decode step.
    assert rows and len(rows) == len({row.split()[0] for row in rows})
    assert {row.split()[0]: int(row.split()[1]) for row in rows} == {
        "svd_mlp_gate_up_kernel": 1,
        "svd_mlp_down_kernel": 1,
        "decode_step_kernel": 3,
    }

    def launch_table(text):  # the header row of the per-launch table
        return [line for line in text.splitlines() if line.startswith("kernel") and "avg DMA B" in line]

    assert not launch_table(out)
    assert "T/V/S/G/D = instructions issued on the Tensor, Vector," in out and "PE fill = mean" in out
    with_launches = run("generate.py", *args, "--profile_launches").stdout
    assert len(launch_table(with_launches)) == 1


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("generate.py", ["--max_new_tokens=0"], "--max_new_tokens"),
        ("generate.py", ["--keep=0"], "--keep must lie in (0, 1]"),
        ("generate.py", ["--temperature=nan"], "--temperature must be a finite number"),
        ("generate.py", ["--top_p=2"], "--top_p must lie in (0, 1]"),
        ("generate.py", ["--prompt_ids=1,-2"], "--prompt_ids must be non-negative integers"),
        ("generate.py", ["--prompt_ids=1,600"], "--prompt_ids: token id 600 is outside the vocabulary range [0, 512)"),
        ("generate.py", ["--model=gemma", "--preset=1b"], "--preset 1b: family gemma has presets ('tiny', '2b')"),
        ("generate.py", ["--checkpoint=/x"], "Unknown command line flag 'checkpoint'"),
        ("perplexity.py", ["--keep=0.5,0"], "--keep must be numbers in (0, 1]"),
        ("perplexity.py", ["--seq_len=1"], "--seq_len"),
        ("tensor_parallel_generate.py", ["--data=0"], "--data"),
        ("tensor_parallel_generate.py", ["--data=2", "--batch=3"], "--data must divide --batch"),
        ("tensor_parallel_generate.py", ["--new_tokens=3"], "Unknown command line flag 'new_tokens'"),
        ("quickstart.py", ["--keep=1.5"], "--keep must lie in (0, 1]"),
    ],
)
def test_bad_flags_are_usage_errors(script, flags, message):
    result = run(script, *flags)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "perplexity" not in result.stdout


def test_quickstart_uses_the_library_rank_rule():
    result = run("quickstart.py", "--tokens=7", "--in_features=300", "--out_features=1000", "--keep=0.5")
    assert result.returncode == 0, result.stderr
    rank = compress.block_aligned_rank(300, 1000, 0.5)
    assert rank == 128 and f"rank {rank})" in result.stdout

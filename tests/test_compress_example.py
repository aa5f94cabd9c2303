"""examples/compress_checkpoint.py: compresses through pipeline.compress_checkpoint, never replaces a user's file,
and turns bad flags into usage errors before any work."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from hf_checkpoints import HF_CONFIG, write_hf_checkpoint

from jax_neuronmm.compress import load_compressed
from jax_neuronmm.models import load_compressed_checkpoint
from jax_neuronmm.pipeline import Recipe, compressed_saving
from jax_neuronmm.pipeline.recipe import RECOMMENDED_METHOD, RECOMMENDED_STEPS

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "compress_checkpoint.py")


def run(*args):
    return subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=600)


def listing(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_cli_compresses_and_loads_back(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    out = tmp_path / "out"
    result = run(
        f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={out}", "--keep=0.5", "--block=16", "--method=svd"
    )
    assert result.returncode == 0, result.stderr
    assert "layers/1/mlp/up_proj" in result.stdout and f"wrote {out}" in result.stdout
    assert sorted(os.listdir(out)) == ["compression_report.json", "config.json", "model.safetensors", "tokenizer.json"]
    _, info = load_compressed(out / "model.safetensors")
    assert info.method == "svd" and info.keep == 0.5
    assert info.ranks == {
        f"layers/{i}/mlp/{name}": 16 for i in range(2) for name in ("down_proj", "gate_proj", "up_proj")
    }
    with open(out / "compression_report.json") as f:
        assert [layer["rank"] for layer in json.load(f)["layers"]] == [16] * 6
    model = load_compressed_checkpoint(out)
    assert model.layers[0].mlp.gate_proj.rank == 16 and model.eos_token_ids == (5, 7)


def test_whitened_calibrates_on_text(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i}" for i in rng.integers(0, HF_CONFIG["vocab_size"], size=400)))
    result = run(
        f"--checkpoint_dir={tmp_path / 'hf'}",
        f"--output_dir={tmp_path / 'out'}",
        "--rank=8",
        "--method=whitened",
        f"--calibration_text={text}",
        "--calibration_tokens=50",
    )
    assert result.returncode == 0, result.stderr
    _, info = load_compressed(tmp_path / "out" / "model.safetensors")
    assert info.method == "whitened" and set(info.ranks.values()) == {8}


def test_default_is_the_recommended_calibrated_pipeline(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i}" for i in rng.integers(0, HF_CONFIG["vocab_size"], size=400)))
    result = run(
        f"--checkpoint_dir={tmp_path / 'hf'}",
        f"--output_dir={tmp_path / 'out'}",
        "--rank=8",
        f"--calibration_text={text}",
        "--calibration_tokens=50",
    )
    assert result.returncode == 0, result.stderr
    _, info = load_compressed(tmp_path / "out" / "model.safetensors")
    # one rank for every projection: the recommended pipeline without "allocate", which chooses ranks
    assert info.method == "+".join((RECOMMENDED_METHOD, *(s for s in RECOMMENDED_STEPS if s != "allocate")))


def test_pruned_mlps_are_written_and_load_back_narrower(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i}" for i in rng.integers(0, HF_CONFIG["vocab_size"], size=400)))
    flags = ["--mlp_form=pruned", "--keep=0.6", "--block=8", "--method=whitened", "--steps=fisher"]
    result = run(
        f"--checkpoint_dir={tmp_path / 'hf'}",
        f"--output_dir={tmp_path / 'out'}",
        f"--calibration_text={text}",
        "--calibration_tokens=50",
        *flags,
    )
    assert result.returncode == 0, result.stderr
    loaded = load_compressed_checkpoint(tmp_path / "out")
    assert loaded.config.intermediate_size == 80  # 0.6 of 136, down to a multiple of 8
    assert loaded.layers[0].mlp.gate_proj.kernel[...].shape == (HF_CONFIG["hidden_size"], 80)


def test_steps_need_the_whitened_method(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    result = run(f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={tmp_path / 'out'}", "--steps=sequential")
    assert result.returncode != 0 and "--steps needs --method whitened" in result.stderr
    assert not (tmp_path / "out").exists()


def test_refuses_to_write_into_the_source_or_over_files(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    source = listing(tmp_path / "hf")
    # Used to overwrite the source's model.safetensors and then crash with shutil.SameFileError.
    result = run(f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={tmp_path / 'hf'}")
    assert result.returncode != 0 and "is the source checkpoint directory" in result.stderr
    assert str(tmp_path / "hf") in result.stderr and "Traceback" not in result.stderr
    assert listing(tmp_path / "hf") == source
    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy" / "model.safetensors").write_bytes(b"the user's weights")
    result = run(f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={tmp_path / 'busy'}")
    assert result.returncode != 0 and "already holds ['model.safetensors']" in result.stderr
    assert listing(tmp_path / "busy") == {"model.safetensors": b"the user's weights"}


def test_bad_flags_are_usage_errors(tmp_path):
    for flags, message in (
        (["--keep=0"], "--keep must lie in (0, 1]"),
        (["--keep=0.5", "--rank=8"], "give --keep or --rank, not both"),
        (["--rank=0"], "--rank"),
        (["--include=mlp,ffn"], "--include takes mlp and/or attention"),
        (["--allocation_solver=dp"], "value should be one of <lagrangian|exact>"),
        (["--mlp_form=pruned", "--method=svd"], "--mlp_form pruned keeps a fraction --keep"),
        (["--mlp_form=pruned", "--rank=8"], "--mlp_form pruned keeps a fraction --keep"),
    ):
        result = run(f"--checkpoint_dir={tmp_path}", f"--output_dir={tmp_path / 'out'}", *flags)
        assert result.returncode != 0 and message in result.stderr, (flags, result.stderr)
        assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "out")


def test_rank_beyond_a_projection_is_a_usage_error_before_loading(rng, tmp_path, monkeypatch):
    # --rank 100000 used to be a traceback from truncated_svd after the model had loaded.
    write_hf_checkpoint(rng, tmp_path / "hf")
    smallest = min(HF_CONFIG["hidden_size"], HF_CONFIG["intermediate_size"])
    for flags in (["--method=svd", "--rank=100000"], ["--method=svd", f"--rank={smallest + 1}"]):
        result = run(f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={tmp_path / 'out'}", *flags)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert f"--rank: got {flags[1].split('=')[1]}, expected at most {smallest}" in result.stderr
        assert not os.path.exists(tmp_path / "out")
    # The library refuses it before reading a weight (load_hf is never reached).
    monkeypatch.setattr(compressed_saving, "load_hf", lambda *args, **kwargs: pytest.fail("weights were loaded"))
    with pytest.raises(ValueError, match=f"rank: got {smallest + 1}, expected at most {smallest}: layers/0/mlp/"):
        compressed_saving.compress_checkpoint(
            tmp_path / "hf", tmp_path / "out", Recipe(rank=smallest + 1, method="svd")
        )
    with pytest.raises(ValueError, match=f"rank: got 70, expected at most {HF_CONFIG['hidden_size']}: lm_head"):
        compressed_saving.compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(rank=70, include=("head",)))
    assert not os.path.exists(tmp_path / "out")


def _read_only_directory(tmp_path):
    """A directory this process cannot create files in: a chmod 555 folder, or (as root, which ignores the mode)
    a folder under /sys, which is read-only even for root; None when neither is available."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if not os.access(locked, os.W_OK):
        return locked
    try:
        open("/sys/jax_neuronmm_probe", "wb").close()
    except OSError:
        return pathlib.Path("/sys")
    os.remove("/sys/jax_neuronmm_probe")
    return None


@pytest.mark.parametrize("case", ["missing", "directory", "not_utf8"])
def test_unreadable_calibration_text_is_a_usage_error(rng, tmp_path, case):
    write_hf_checkpoint(rng, tmp_path / "hf")
    text = tmp_path / "calibration.txt"
    if case == "directory":
        text.mkdir()
    elif case == "not_utf8":
        text.write_bytes(b"w1 w2 \xff\xfe w3" * 50)
    expected = {"missing": "cannot read it", "directory": "cannot read it", "not_utf8": "not UTF-8 text"}[case]
    result = run(
        f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={tmp_path / 'out'}", f"--calibration_text={text}"
    )
    assert result.returncode != 0 and f"--calibration_text {text}: {expected}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_malformed_source_config_is_a_usage_error(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama",')
    result = run(f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={tmp_path / 'out'}", "--method=svd")
    assert result.returncode != 0 and "config.json: not valid JSON" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["empty", "file", "under_a_file", "read_only"])
def test_bad_output_dir_is_a_usage_error_before_compressing(rng, tmp_path, case):
    write_hf_checkpoint(rng, tmp_path / "hf")
    (tmp_path / "a_file").write_text("the user's")
    if case == "read_only":
        locked = _read_only_directory(tmp_path)
        if locked is None:
            pytest.skip("no directory here refuses this process's writes")
        out, expected = locked / "out", "cannot create files in"
    else:
        out, expected = {
            "empty": ("", "out_dir: got an empty path"),
            "file": (tmp_path / "a_file", "is a file, expected a directory"),
            "under_a_file": (tmp_path / "a_file" / "out", "is a file, expected a directory"),
        }[case]
    # --method svd needs no text; the default pipeline would read the calibration text first: both check first.
    for method in ("svd", "recommended"):
        result = run(f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={out}", "--rank=8", f"--method={method}")
        assert result.returncode != 0 and expected in result.stderr, result.stderr
        # Refused before any work: no compression progress bar, no report.
        assert "Traceback" not in result.stderr and "layer/s" not in result.stderr and result.stdout == ""
    assert (tmp_path / "a_file").read_text() == "the user's"

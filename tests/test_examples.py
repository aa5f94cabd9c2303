"""The example CLIs: one flag vocabulary, bad flag values as usage errors (no traceback, no work done),
generate.py on a compressed checkpoint directory and its grouped emulator profile, quickstart's rank rule."""

import functools
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from hf_checkpoints import write_hf_checkpoint

from jax_neuronmm import compress, models, pipeline
from jax_neuronmm.models import generate, load_compressed_checkpoint
from jax_neuronmm.pipeline import Recipe, compress_checkpoint

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def run(script, *args):
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True, timeout=600
    )


def test_generate_runs_a_compressed_checkpoint_directory(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(rank=8))
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


def test_tensor_parallel_generate_decodes_through_the_sharded_decode_step():
    result = run(
        "tensor_parallel_generate.py",
        "--cpu_devices=2",
        "--data=1",
        "--model=2",
        "--batch=2",
        "--prompt_tokens=3",
        "--max_new_tokens=3",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "decode steps ran through decode_step sharded over mesh axis 'model': 2 ranks, each on its Megatron shard "
        "(spec.tensor_parallel=2), rows not split; one step compiles to collectives [('all-reduce', "
        "'f32[2,1,32]'), "
        "('all-reduce', 'f32[2,1,48]'), ('all-gather', 'f32[2,1,512]')]" in result.stdout
    ), result.stdout
    assert "same tokens on one device and on the mesh" in result.stdout


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("generate.py", ["--max_new_tokens=0"], "--max_new_tokens"),
        ("generate.py", ["--keep=0"], "--keep must lie in (0, 1]"),
        ("generate.py", ["--temperature=nan"], "--temperature must be a finite number"),
        ("generate.py", ["--top_p=2"], "--top_p must lie in (0, 1]"),
        ("generate.py", ["--prompt_ids=1,-2"], "--prompt_ids must be one or more non-negative integers"),
        ("generate.py", ["--prompt_ids=1,600"], "--prompt_ids: token id 600 is outside the vocabulary range [0, 512)"),
        ("generate.py", ["--model=gemma", "--preset=1b"], "--preset 1b: family gemma has presets ('tiny', '2b')"),
        ("generate.py", ["--prompt_ids="], "--prompt_ids must be one or more non-negative integers"),
        (
            "generate.py",
            ["--checkpoint=/nonexistent"],
            "--checkpoint /nonexistent: path: '/nonexistent' does not exist",
        ),
        ("generate.py", ["--checkpoint_dir=/nonexistent"], "--checkpoint /nonexistent: path: '/nonexistent' does not"),
        ("generate.py", ["--checkpoint=/x", "--checkpoint_tokens=3"], "Unknown command line flag 'checkpoint_tokens'"),
        ("perplexity.py", ["--text=/nonexistent.txt"], "--text /nonexistent.txt: cannot read it (No such file"),
        ("perplexity.py", ["--text=/"], "--text /: cannot read it (Is a directory)"),
        ("perplexity.py", ["--checkpoint=/nonexistent"], "--checkpoint /nonexistent: path: '/nonexistent' does not"),
        ("perplexity.py", ["--keep=0.5,0"], "--keep must be numbers in (0, 1]"),
        ("perplexity.py", ["--seq_len=1"], "--seq_len"),
        ("tensor_parallel_generate.py", ["--data=0"], "--data"),
        ("tensor_parallel_generate.py", ["--data=2", "--batch=3"], "--data must divide --batch"),
        ("tensor_parallel_generate.py", ["--new_tokens=3"], "Unknown command line flag 'new_tokens'"),
        ("tensor_parallel_generate.py", ["--timeout_s=-1"], "--timeout_s must be a finite number > 0"),
        ("tensor_parallel_generate.py", ["--timeout_s=nan"], "--timeout_s must be a finite number > 0"),
        ("tensor_parallel_generate.py", ["--connect_timeout_s=inf"], "--connect_timeout_s must be a finite number > 0"),
        ("tensor_parallel_generate.py", ["--coordinator_address=localhost"], "--coordinator_address must be HOST:PORT"),
        ("tensor_parallel_generate.py", ["--process_id=1", "--num_processes=2"], "--process_id needs --coordinator"),
        (
            "tensor_parallel_generate.py",
            ["--checkpoint_dir=/nonexistent"],
            "--checkpoint_dir /nonexistent: no such directory",
        ),
        ("quickstart.py", ["--keep=1.5"], "--keep must lie in (0, 1]"),
    ],
)
def test_bad_flags_are_usage_errors(script, flags, message):
    result = run(script, *flags)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "perplexity" not in result.stdout


def test_tensor_parallel_generate_names_a_checkpoint_dir_it_cannot_use(rng, tmp_path):
    # A compressed checkpoint (the example compresses an HF one itself) and a directory that is no checkpoint: usage
    # errors before any work, not tracebacks; an HF checkpoint directory missing its weights names them.
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "compressed", Recipe(rank=8))
    (tmp_path / "empty").mkdir()
    for directory, message in (
        ("compressed", "a compressed checkpoint; this example compresses an HF checkpoint itself"),
        ("empty", "no config.json"),
    ):
        result = run("tensor_parallel_generate.py", f"--checkpoint_dir={tmp_path / directory}", "--num_processes=2")
        assert result.returncode != 0 and f"--checkpoint_dir {tmp_path / directory}: {message}" in result.stderr
        assert "Traceback" not in result.stderr and "processes exited" not in result.stdout, result.stderr
    for weights in (tmp_path / "hf").glob("*.safetensors"):
        weights.unlink()
    result = run(
        "tensor_parallel_generate.py", f"--checkpoint_dir={tmp_path / 'hf'}", "--cpu_devices=2", "--data=1", "--model=2"
    )
    assert result.returncode != 0 and f"--checkpoint_dir {tmp_path / 'hf'}: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_perplexity_text_that_is_not_utf8_is_a_usage_error(tmp_path):
    text = tmp_path / "latin1.txt"
    text.write_bytes("caf\u00e9 ".encode("latin-1") * 100)
    result = run("perplexity.py", f"--text={text}")
    assert result.returncode != 0 and f"--text {text}: not UTF-8 text" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_generate_refuses_a_tampered_compressed_checkpoint(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(rank=8))
    weights = tmp_path / "out" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    result = run("generate.py", f"--checkpoint={tmp_path / 'out'}", "--prompt_ids=1,2", "--max_new_tokens=2")
    assert result.returncode != 0 and "checksum mismatch" in result.stderr, result.stderr
    assert f"--checkpoint {tmp_path / 'out'}" in result.stderr and "Traceback" not in result.stderr


def _printed_perplexity(stdout, row):
    return float(
        next(line for line in stdout.splitlines() if line.startswith(row)).split()[-1 if row != "dense" else 1]
    )


def test_perplexity_scores_a_compressed_checkpoint_as_saved(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(rank=8))
    words = rng.integers(0, 97, size=70)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in words))
    result = run("perplexity.py", f"--checkpoint={tmp_path / 'out'}", f"--text={text}", "--seq_len=16")
    assert result.returncode == 0, result.stderr
    model = load_compressed_checkpoint(tmp_path / "out")
    want = models.perplexity(model, words[:64].reshape(4, 16))
    assert abs(_printed_perplexity(result.stdout, "compressed checkpoint") - want) < 1e-3 * want, result.stdout
    result = run("perplexity.py", f"--checkpoint_dir={tmp_path / 'out'}", f"--text={text}", "--keep=0.5")
    assert result.returncode != 0 and "is compressed already" in result.stderr and "Traceback" not in result.stderr


def test_generate_and_perplexity_open_a_gguf_file(tmp_path):
    from gguf_files import write_gguf

    path = tmp_path / "model.gguf"
    write_gguf(str(path), "llama", tied=True, bias=False, tokenizer="llama", seed=8)
    model = models.load_gguf(str(path))
    result = run("generate.py", f"--checkpoint={path}", "--prompt_ids=5,9,300,7", "--max_new_tokens=3")
    assert result.returncode == 0, result.stderr
    out = np.asarray(generate(model, [[5, 9, 300, 7]], 3, eos_id=model.eos_token_ids))
    assert f"new ids:    {out[0, 4:].tolist()}" in result.stdout
    assert f"perplexity of prompt + continuation: {models.perplexity(model, out):.3f}" in result.stdout
    text = tmp_path / "text.txt"
    text.write_text("Then the hello world, the theme: hello\n\nthe end " * 6)
    result = run("perplexity.py", f"--checkpoint={path}", f"--text={text}", "--seq_len=16", "--keep=0.5")
    assert result.returncode == 0, result.stderr
    ids = np.array(model.tokenizer.encode(text.read_text()).ids)
    count = len(ids) // 16
    want = models.perplexity(model, ids[: count * 16].reshape(count, 16))
    assert abs(_printed_perplexity(result.stdout, "dense") - want) < 1e-3 * want, result.stdout


def test_quickstart_uses_the_library_rank_rule():
    result = run("quickstart.py", "--tokens=7", "--in_features=300", "--out_features=1000", "--keep=0.5")
    assert result.returncode == 0, result.stderr
    rank = compress.block_aligned_rank(300, 1000, 0.5)
    assert rank == 128 and f"rank {rank})" in result.stdout


@functools.cache
def _demo_module():
    """examples/demo.py imported once (it defines absl flags; the functions tests call read none)."""
    spec = importlib.util.spec_from_file_location("demo", os.path.join(EXAMPLES, "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


@pytest.mark.parametrize("mlp_form", ["pruned", "factored"])
def test_the_demo_cache_holds_the_compressed_mlps(tmp_path, mlp_form):
    demo = _demo_module()
    dense = models.from_preset("gemma3", "tiny", num_layers=2, vocab_size=300, seed=5)
    ids = np.random.default_rng(6).integers(0, 300, (12, 29))
    compressed = pipeline.compress_model(
        dense,
        pipeline.Recipe(keep=0.6, mlp_form=mlp_form, method="whitened", block=8),
        calibration_ids=ids,
        progress=False,
    )
    cache = str(tmp_path / "mlps.safetensors")
    compress.save_compressed(cache, {"layers": demo._mlp_weights(compressed)})
    loaded = demo._from_cache(dense, cache)
    assert loaded.config == compressed.config
    np.testing.assert_array_equal(np.asarray(loaded(ids[:2])), np.asarray(compressed(ids[:2])))
    if mlp_form == "pruned":
        assert loaded.layers[1].mlp.up_proj.kernel.kept == compressed.layers[1].mlp.up_proj.kernel.kept
    # A cache of another model's MLPs is refused (the demo then compresses again).
    other = models.from_preset("gemma3", "tiny", num_layers=2, vocab_size=300, seed=5, intermediate_size=128)
    with pytest.raises(
        ValueError, match=r"kept: expected distinct neuron indices in \[0, 128\)" if mlp_form == "pruned" else "shape"
    ):
        demo._from_cache(other, cache)


def test_the_demo_table_scores_every_kind_against_the_dense_model(capsys):
    demo = _demo_module()
    dense = models.from_preset("gemma3", "tiny", num_layers=2, vocab_size=300, seed=5)
    fp8 = pipeline.quantize_model(dense, "float8_e4m3", progress=False)
    rng = np.random.default_rng(8)
    windows = {"declaration": rng.integers(0, 300, (3, 21)), "license": rng.integers(0, 300, (2, 21))}
    rows = demo.quality_rows(dense, {"dense": dense, "fp8": fp8}, windows)
    for kind, ids in windows.items():
        interval, top1 = rows["dense"][kind]
        assert interval.ratio == 1.0 and top1 == 1.0 and interval.windows == ids.shape[0]
        # float64 reference: exp(mean NLL(fp8) - mean NLL(dense)) over every prediction of the kind's windows
        nll = {}
        for name, model in (("dense", dense), ("fp8", fp8)):
            logits = np.asarray(model(ids), np.float64)[:, :-1]
            log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            log_probs -= logits.max(-1, keepdims=True)
            nll[name] = -np.take_along_axis(log_probs, ids[:, 1:, None], axis=-1).mean()
        interval, top1 = rows["fp8"][kind]
        np.testing.assert_allclose(interval.ratio, np.exp(nll["fp8"] - nll["dense"]), rtol=1e-4)
        assert interval.low <= interval.ratio <= interval.high and interval.ratio != 1.0 and 0 < top1 <= 1
    demo.print_quality(rows, windows, {"dense": 0.0, "fp8": 0.45})
    out = capsys.readouterr().out
    worst = max(rows["fp8"][kind][0].ratio for kind in windows)
    assert "sample.txt" in out and f"{worst:.3f}x" in out and "-45%" in out

"""compress_checkpoint / load_compressed_checkpoint: the directory loads back as compress_model's model; the output
never replaces a user's file; every loader error names the file and what is wrong."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_files import edit_metadata
from flax import nnx
from hf_checkpoints import HF_CONFIG, write_hf_checkpoint

from jax_neuronmm.compress import CheckpointError, allocation, load_compressed, save_compressed, tree
from jax_neuronmm.compress.checkpoint import FORMAT_V1, HEADER_SHA256, _digest
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models import GatedMLP, generate, load_compressed_checkpoint, load_hf
from jax_neuronmm.models.compressed_loading import FILES_SHA256, PRUNED_NEURONS
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.pipeline import Recipe, compress_checkpoint, compress_model
from jax_neuronmm.pipeline.distill import is_trained
from jax_neuronmm.pipeline.pruning import mlp_width

KEEP, BLOCK = 0.5, 16
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
_logits = nnx.jit(lambda model, ids: model(ids))


@pytest.mark.parametrize("include", [("mlp",), ("mlp", "attention")], ids=["mlp", "mlp+attention"])
def test_loads_what_compress_model_builds(rng, tmp_path, include):
    write_hf_checkpoint(rng, tmp_path / "hf")
    report = compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, include=include, block=BLOCK))
    assert sorted(os.listdir(tmp_path / "out")) == [
        "compression_report.json",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert len(report.layers) == 2 * (3 + 4 * ("attention" in include))
    assert all(0 < layer.relative_error < 1 for layer in report.layers)
    assert load_compressed(tmp_path / "out" / "model.safetensors")[1].ranks == report.ranks

    loaded = load_compressed_checkpoint(tmp_path / "out")
    dense = load_hf(str(tmp_path / "hf"))
    expected = compress_model(dense, Recipe(keep=KEEP, include=include, block=BLOCK))

    for loaded_layer, expected_layer in zip(loaded.layers, expected.layers, strict=True):
        assert isinstance(loaded_layer.mlp, SVDMLP)
        assert [getattr(loaded_layer.mlp, name).rank for name in ("gate_proj", "up_proj", "down_proj")] == [
            getattr(expected_layer.mlp, name).rank for name in ("gate_proj", "up_proj", "down_proj")
        ]
        attention_type = SVDLinear if "attention" in include else nnx.Linear
        assert all(
            isinstance(getattr(loaded_layer.self_attn, name), attention_type)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")
        )
    assert loaded.layers[0].mlp.gate_proj.rank < HF_CONFIG["hidden_size"]  # really compressed
    assert loaded.eos_token_ids == (5, 7)
    assert loaded.tokenizer.encode("w3 w11").ids == [3, 11]

    ids = jnp.asarray(np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], size=(2, 9)))
    got = np.asarray(_logits(loaded, ids), np.float64)
    want = np.asarray(_logits(expected, ids), np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.max(np.abs(got - np.asarray(_logits(dense, ids), np.float64))) > 1e-2  # differs from the dense model
    np.testing.assert_array_equal(np.asarray(generate(loaded, ids, 6)), np.asarray(generate(expected, ids, 6)))


def test_bfloat16_load(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, block=BLOCK))
    model = load_compressed_checkpoint(tmp_path / "out", dtype=jnp.bfloat16)
    assert model.layers[1].mlp.down_proj.u.dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(2).integers(0, HF_CONFIG["vocab_size"], size=(1, 7)))
    want = np.asarray(_logits(load_compressed_checkpoint(tmp_path / "out"), ids), np.float64)
    got = np.asarray(_logits(model, ids).astype(jnp.float32), np.float64)
    assert np.max(np.abs(got - want)) < 0.1 * np.max(np.abs(want))


def test_not_a_compressed_checkpoint(rng, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_compressed_checkpoint(tmp_path / "absent")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_compressed_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*compress_checkpoint"):
        load_compressed_checkpoint(tmp_path / "empty")
    write_hf_checkpoint(rng, tmp_path / "hf")  # a plain HF checkpoint is not ours
    with pytest.raises(CheckpointError, match="not written by save_compressed"):
        load_compressed_checkpoint(tmp_path / "hf")

    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, block=BLOCK))
    shutil.copytree(tmp_path / "out", tmp_path / "deeper")
    (tmp_path / "deeper" / "config.json").write_text(json.dumps({**HF_CONFIG, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers/2/"):
        load_compressed_checkpoint(tmp_path / "deeper")
    (tmp_path / "out" / "config.json").write_text(json.dumps({**HF_CONFIG, "hidden_size": 80, "head_dim": 20}))
    with pytest.raises(CheckpointError, match="shape"):
        load_compressed_checkpoint(tmp_path / "out")


def test_partially_factored_mlp_stays_unfused(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(rank=8))
    # Keep only layer 1's gate and up projections factored (compress_model factors whole MLPs).
    params, info = load_compressed(tmp_path / "out" / "model.safetensors")
    dense_model = load_hf(tmp_path / "hf")
    for layer, names in ((0, MLP_NAMES), (1, ("down_proj",))):
        for name in names:
            kernel = np.asarray(getattr(dense_model.layers[layer].mlp, name).kernel[...])
            params["layers"][layer]["mlp"][name] = {"kernel": kernel}
    # The copied files' checksums go along: a checkpoint without them is refused.
    save_compressed(tmp_path / "out" / "model.safetensors", params, metadata=info.user, overwrite=True)
    model = load_compressed_checkpoint(tmp_path / "out")
    assert isinstance(model.layers[0].mlp, GatedMLP) and isinstance(model.layers[0].mlp.gate_proj, nnx.Linear)
    mlp = model.layers[1].mlp
    assert isinstance(mlp, GatedMLP) and isinstance(mlp.down_proj, nnx.Linear)
    assert isinstance(mlp.gate_proj, SVDLinear) and mlp.gate_proj.rank == 8 and mlp.up_proj.rank == 8
    # The gate projection computes x·u·v with the saved factors.
    x = np.random.default_rng(3).standard_normal((4, HF_CONFIG["hidden_size"]))
    u, v = (np.asarray(mlp.gate_proj.u[...], np.float64), np.asarray(mlp.gate_proj.v[...], np.float64))
    np.testing.assert_allclose(np.asarray(mlp.gate_proj(jnp.asarray(x, jnp.float32))), x @ u @ v, atol=1e-4)
    dense = dense_model.layers[1].mlp.gate_proj.kernel[...]
    assert np.linalg.norm(u @ v - np.asarray(dense)) < np.linalg.norm(np.asarray(dense))  # a truncation of it


def _listing(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_output_never_replaces_a_users_file(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    source = _listing(tmp_path / "hf")
    # The source directory itself (the CLI used to overwrite model.safetensors there, then crash).
    for out in (tmp_path / "hf", tmp_path / "hf" / ".." / "hf"):
        with pytest.raises(FileExistsError, match=f"out_dir: '{out}' is the source checkpoint directory"):
            compress_checkpoint(tmp_path / "hf", out, Recipe(keep=KEEP, block=BLOCK))
    assert _listing(tmp_path / "hf") == source
    # A directory holding a file the output would write: refused before anything is written.
    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy" / "tokenizer.json").write_text("the user's tokenizer")
    (tmp_path / "busy" / "notes.txt").write_text("unrelated")
    with pytest.raises(FileExistsError, match=r"out_dir: '.*busy' already holds \['tokenizer.json'\]"):
        compress_checkpoint(tmp_path / "hf", tmp_path / "busy", Recipe(keep=KEEP, block=BLOCK))
    assert _listing(tmp_path / "busy") == {"notes.txt": b"unrelated", "tokenizer.json": b"the user's tokenizer"}
    # Unrelated files may stay; a second run into a finished output directory is refused.
    os.remove(tmp_path / "busy" / "tokenizer.json")
    compress_checkpoint(tmp_path / "hf", tmp_path / "busy", Recipe(keep=KEEP, block=BLOCK))
    written = _listing(tmp_path / "busy")
    with pytest.raises(FileExistsError, match="already holds"):
        compress_checkpoint(tmp_path / "hf", tmp_path / "busy", Recipe(rank=4))
    assert _listing(tmp_path / "busy") == written and _listing(tmp_path / "hf") == source
    with pytest.raises(ValueError, match="keep, rank: got keep=0.5 and rank=4"):
        compress_checkpoint(tmp_path / "hf", tmp_path / "other", Recipe(keep=0.5, rank=4))


def test_output_dir_is_checked_before_compressing(rng, tmp_path, monkeypatch):
    write_hf_checkpoint(rng, tmp_path / "hf")
    (tmp_path / "a_file").write_text("the user's")
    loaded = []
    monkeypatch.setattr("jax_neuronmm.pipeline.compressed_saving.load_hf", lambda *a, **k: loaded.append(a))
    for out, error, match in (
        ("", ValueError, "out_dir: got an empty path"),
        (tmp_path / "a_file", NotADirectoryError, "a_file' is a file, expected a directory"),
        (tmp_path / "a_file" / "sub" / "out", NotADirectoryError, "a_file' is a file, expected a directory"),
    ):
        with pytest.raises(error, match=match):
            compress_checkpoint(tmp_path / "hf", out, Recipe(rank=8))
    # A directory that refuses new files (as root, permission bits do not: make the probe fail instead).
    monkeypatch.setattr(
        "jax_neuronmm.pipeline.compressed_saving.tempfile.TemporaryFile",
        lambda dir: (_ for _ in ()).throw(PermissionError(13, "Permission denied")),
    )
    with pytest.raises(
        PermissionError, match=r"out_dir: '.*new/out': cannot create files in '.*' \(Permission denied\)"
    ):
        compress_checkpoint(tmp_path / "hf", tmp_path / "new" / "out", Recipe(rank=8))
    assert loaded == [] and sorted(os.listdir(tmp_path)) == ["a_file", "hf"]


def test_config_with_fewer_layers_than_the_tensors(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, block=BLOCK))
    (tmp_path / "out" / "config.json").write_text(json.dumps({**HF_CONFIG, "num_hidden_layers": 1}))
    # Used to be an IndexError from walking to layers[1].
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors' has factors u, v at layers/1/mlp/"
        r"(gate|up|down)_proj, but the model config.json describes",
    ):
        load_compressed_checkpoint(tmp_path / "out")


@pytest.mark.parametrize(
    "name, edit",
    [
        ("config.json", lambda c: {**c, "rope_theta": c.get("rope_theta", 10000.0) * 2}),
        ("config.json", lambda c: {**c, "rms_norm_eps": 0.5}),
        ("tokenizer.json", None),
    ],
    ids=["rope_theta", "rms_norm_eps", "tokenizer"],
)
def test_copied_files_are_inside_the_checksums(rng, tmp_path, name, edit):
    # An edited config.json used to load silently, with different logits.
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, block=BLOCK))
    file = tmp_path / "out" / name
    good = file.read_bytes()
    if edit is None:
        file.write_bytes(good.replace(b"w3", b"w9", 1))
        assert file.read_bytes() != good
    else:
        file.write_text(json.dumps(edit(json.loads(good))))
    with pytest.raises(CheckpointError, match=rf"{file}: checksum mismatch: the file differs"):
        load_compressed_checkpoint(tmp_path / "out")
    file.write_bytes(good)
    load_compressed_checkpoint(tmp_path / "out")
    os.remove(file)
    with pytest.raises((CheckpointError, FileNotFoundError), match=rf"{file}|has no {name}"):
        load_compressed_checkpoint(tmp_path / "out")
    # A config or tokenizer file the checkpoint was not written with is not read unchecked either.
    file.write_bytes(good)
    added = tmp_path / "out" / "tokenizer_config.json"
    added.write_text("{}")
    with pytest.raises(CheckpointError, match=rf"{added}: not one of the files .* was written with"):
        load_compressed_checkpoint(tmp_path / "out")


def test_copied_files_checksums_cannot_be_stripped(rng, tmp_path):
    # Deleting files_sha256 from the header, then editing config.json, used to load the edited config silently.
    write_hf_checkpoint(rng, tmp_path / "hf")
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, block=BLOCK))
    weights, config = tmp_path / "out" / "model.safetensors", tmp_path / "out" / "config.json"
    good = weights.read_bytes()
    config.write_text(json.dumps({**HF_CONFIG, "rms_norm_eps": 0.5}))

    def strip(metadata):
        user = json.loads(metadata["user"])
        del user[FILES_SHA256]
        metadata["user"] = json.dumps(user)

    edit_metadata(weights, strip, reseal=False)
    with pytest.raises(CheckpointError, match="metadata checksum mismatch"):
        load_compressed_checkpoint(tmp_path / "out")
    # Re-sealed, or in the earlier format that had no metadata checksum: no checksums, no load.
    weights.write_bytes(good)
    edit_metadata(weights, strip, reseal=True)
    with pytest.raises(CheckpointError, match=f"records no checksums of config.json .*'{FILES_SHA256}'"):
        load_compressed_checkpoint(tmp_path / "out")
    params, _ = load_compressed(tmp_path / "out" / "model.safetensors")
    tensors = {tree.join(keys): np.asarray(value) for keys, value in tree.iter_leaves(params)}

    def downgrade(metadata):
        metadata["format"] = FORMAT_V1
        metadata["sha256"] = json.dumps({name: _digest(array, None) for name, array in tensors.items()})
        del metadata[HEADER_SHA256]

    edit_metadata(weights, downgrade, reseal=False)
    with pytest.raises(CheckpointError, match=f"records no checksums of config.json .*'{FILES_SHA256}'"):
        load_compressed_checkpoint(tmp_path / "out")
    # An earlier-format checkpoint that carries its checksums still loads, and still checks config.json.
    weights.write_bytes(good)
    edit_metadata(weights, downgrade, reseal=False)
    with pytest.raises(CheckpointError, match=f"{config}: checksum mismatch"):
        load_compressed_checkpoint(tmp_path / "out")
    shutil.copy(tmp_path / "hf" / "config.json", config)
    expected = load_compressed_checkpoint(tmp_path / "out")
    ids = jnp.asarray(np.random.default_rng(3).integers(0, HF_CONFIG["vocab_size"], size=(2, 7)))
    weights.write_bytes(good)
    np.testing.assert_array_equal(
        np.asarray(_logits(load_compressed_checkpoint(tmp_path / "out"), ids)), np.asarray(_logits(expected, ids))
    )


@pytest.mark.parametrize("loader", ["load_hf", "load_compressed_checkpoint"])
def test_loader_errors_name_the_file(rng, tmp_path, loader):
    write_hf_checkpoint(rng, tmp_path / "hf")
    if loader == "load_hf":
        path, load = tmp_path / "hf", load_hf
    else:
        compress_checkpoint(tmp_path / "hf", tmp_path / "out", Recipe(keep=KEEP, block=BLOCK))
        path, load = tmp_path / "out", load_compressed_checkpoint
    config, weights, tokenizer = (path / name for name in ("config.json", "model.safetensors", "tokenizer.json"))
    good = {file: file.read_bytes() for file in (config, weights, tokenizer)}

    config.write_text('{"model_type": "llama", "vocab_size": 97,')
    with pytest.raises(ValueError, match=f"{config}: not valid JSON"):
        load(path)
    config.write_text(json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=f"{config}: lacks the required field 'hidden_size'"):
        load(path)
    config.write_text(json.dumps({**HF_CONFIG, "num_hidden_layers": "two"}))
    with pytest.raises(ValueError, match=f"{config}: .*'two'"):
        load(path)
    config.write_bytes(good[config])

    tokenizer.write_text('{"model": {"type": "WordLevel"')
    with pytest.raises(ValueError, match=f"{tokenizer}: not a readable tokenizers file"):
        load(path)
    tokenizer.write_bytes(good[tokenizer])

    weights.write_bytes(good[weights][:-200])  # truncated
    with pytest.raises(CheckpointError, match=f"{weights}'?:? (is )?corrupt"):
        load(path)
    weights.write_bytes(good[weights])
    assert load(path).tokenizer.encode("w3").ids == [3]


def test_projections_left_dense_by_allocation_round_trip(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    calibration = np.random.default_rng(4).integers(0, HF_CONFIG["vocab_size"], size=(16, 16))
    recipe = Recipe(keep=0.8, block=8, steps=("fisher", "allocate"), mlp_form="factored")
    report = compress_checkpoint(tmp_path / "hf", tmp_path / "out", recipe, calibration_ids=calibration)
    dense_entries = [layer for layer in report.layers if layer.rank is None]
    assert dense_entries and len(report.layers) == 2 * 3  # every MLP projection listed, the dense ones too
    assert all(layer.params_after == layer.params_before and layer.relative_error == 0 for layer in dense_entries)
    assert sum(layer.params_after for layer in report.layers) <= 0.8 * sum(
        layer.params_before for layer in report.layers
    )
    assert "dense" in str(report)

    loaded = load_compressed_checkpoint(tmp_path / "out")
    dense = load_hf(str(tmp_path / "hf"))
    expected = compress_model(dense, recipe, calibration_ids=calibration, progress=False)
    for layer in dense_entries:
        index, name = int(layer.path.split("/")[1]), layer.path.split("/")[-1]
        assert isinstance(loaded.layers[index].mlp, GatedMLP)
        assert isinstance(getattr(loaded.layers[index].mlp, name), nnx.Linear)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, HF_CONFIG["vocab_size"], size=(2, 9)))
    np.testing.assert_allclose(
        np.asarray(_logits(loaded, ids), np.float64), np.asarray(_logits(expected, ids), np.float64), atol=1e-5, rtol=0
    )


def test_allocation_options_reach_compress_model(rng, tmp_path, monkeypatch):
    write_hf_checkpoint(rng, tmp_path / "hf")
    calibration = np.random.default_rng(4).integers(0, HF_CONFIG["vocab_size"], size=(16, 16))
    recipe = Recipe(
        keep=0.8,
        block=8,
        steps=("fisher", "allocate"),
        mlp_form="factored",
        allow_dense=False,
        allocation_solver="exact",
    )
    solvers = []
    allocate = allocation.allocate_ranks
    monkeypatch.setattr(
        allocation,
        "allocate_ranks",
        lambda *args, **kwargs: solvers.append(kwargs["solver"]) or allocate(*args, **kwargs),
    )
    report = compress_checkpoint(tmp_path / "hf", tmp_path / "out", recipe, calibration_ids=calibration)
    assert solvers == ["exact"]
    # Every projection factored (at 0.8 this model keeps some dense when allowed: the round-trip test above).
    assert all(layer.rank is not None for layer in report.layers)
    expected = compress_model(load_hf(str(tmp_path / "hf")), recipe, calibration_ids=calibration, progress=False)
    assert report.ranks == {
        f"layers/{index}/mlp/{name}": getattr(layer.mlp, name).rank
        for index, layer in enumerate(expected.layers)
        for name in MLP_NAMES
    }


def test_pruned_mlps_round_trip(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    calibration = np.random.default_rng(6).integers(0, HF_CONFIG["vocab_size"], size=(16, 16))
    recipe = Recipe(keep=0.6, block=8, steps=("fisher",), mlp_form="pruned", include=("mlp", "attention"))
    report = compress_checkpoint(tmp_path / "hf", tmp_path / "out", recipe, calibration_ids=calibration)
    width = mlp_width(HF_CONFIG["intermediate_size"], 0.6, 8)
    assert width == 80  # 0.6 of 136 is 81.6
    mlp_entries = [layer for layer in report.layers if "/mlp/" in layer.path]
    assert len(mlp_entries) == 2 * 3 and len(report.layers) == 2 * 7
    for entry in mlp_entries:
        assert entry.rank is None and entry.params_after * HF_CONFIG["intermediate_size"] == entry.params_before * width
        assert 0 < entry.relative_error < 1, entry

    loaded = load_compressed_checkpoint(tmp_path / "out")
    expected = compress_model(load_hf(str(tmp_path / "hf")), recipe, calibration_ids=calibration, progress=False)
    assert loaded.config.intermediate_size == expected.config.intermediate_size == width
    assert loaded.layers[1].mlp.down_proj.kernel[...].shape == (width, HF_CONFIG["hidden_size"])
    ids = jnp.asarray(np.random.default_rng(7).integers(0, HF_CONFIG["vocab_size"], size=(2, 9)))
    np.testing.assert_allclose(
        np.asarray(_logits(loaded, ids), np.float64), np.asarray(_logits(expected, ids), np.float64), atol=1e-5, rtol=0
    )
    np.testing.assert_array_equal(np.asarray(generate(loaded, ids, 5)), np.asarray(generate(expected, ids, 5)))
    # The kept neurons come back with the kernels, so distilling the loaded model trains them again.
    for loaded_layer, expected_layer in zip(loaded.layers, expected.layers):
        for name in MLP_NAMES:
            kernel = getattr(loaded_layer.mlp, name).kernel
            assert isinstance(kernel, PrunedKernel) and kernel.kept == getattr(expected_layer.mlp, name).kernel.kept
    trained = {keys for keys, _ in nnx.to_flat_state(nnx.state(loaded, is_trained))}
    assert {keys[2:] for keys in trained if keys[2] == "mlp"} == {("mlp", name, "kernel") for name in MLP_NAMES}

    # Metadata that lost or damaged the kept neurons is named.
    params, info = load_compressed(tmp_path / "out" / "model.safetensors")
    kept = json.loads(info.user[PRUNED_NEURONS])
    for name, user in (
        ("unlisted", {k: v for k, v in info.user.items() if k != PRUNED_NEURONS}),
        ("short", {**info.user, PRUNED_NEURONS: json.dumps([kept[0][:-1], kept[1]])}),
        ("one_layer", {**info.user, PRUNED_NEURONS: json.dumps(kept[:1])}),
    ):
        shutil.copytree(tmp_path / "out", tmp_path / name)
        os.remove(tmp_path / name / "model.safetensors")
        save_compressed(tmp_path / name / "model.safetensors", params, metadata=user)
        with pytest.raises(CheckpointError, match=f"{name}/model.safetensors'?: .*{PRUNED_NEURONS}"):
            load_compressed_checkpoint(tmp_path / name)

    # A checkpoint whose layers' MLPs differ in width names the file and the widths.
    params, info = load_compressed(tmp_path / "out" / "model.safetensors")
    mlp = params["layers"][1]["mlp"]
    mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"] = (mlp[n]["kernel"][:, :-8] for n in ("gate_proj", "up_proj"))
    mlp["down_proj"]["kernel"] = mlp["down_proj"]["kernel"][:-8]
    shutil.copytree(tmp_path / "out", tmp_path / "uneven")
    os.remove(tmp_path / "uneven" / "model.safetensors")
    save_compressed(tmp_path / "uneven" / "model.safetensors", params, metadata=info.user)
    with pytest.raises(CheckpointError, match=r"uneven/model.safetensors'?: MLP widths \[\(0, 80\), \(1, 72\)\]"):
        load_compressed_checkpoint(tmp_path / "uneven")

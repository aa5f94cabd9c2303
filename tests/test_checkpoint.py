"""save_compressed / load_compressed: round trips, metadata, atomic writes, corruption and mismatch errors."""

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from checkpoint_files import edit_metadata, rewrite_header, swap, swap_json_entries
from flax import nnx

from jax_neuronmm.compress import CheckpointError, compress_params, load_compressed, save_compressed
from jax_neuronmm.compress.checkpoint import FORMAT_V1, HEADER_SHA256, _digest, header_digest, write_atomically
from jax_neuronmm.nn import SVDLinear


def compressed_linen(rng):
    params = {
        "params": {
            "embed": {"embedding": jnp.asarray(rng.standard_normal((20, 24)), jnp.bfloat16)},
            "layers_0": {
                "mlp": {
                    "up_proj": {"kernel": jnp.asarray(rng.standard_normal((24, 70)), jnp.float32)},
                    "down_proj": {
                        "kernel": jnp.asarray(rng.standard_normal((70, 24)), jnp.float32),
                        "bias": jnp.asarray(rng.standard_normal(24), jnp.float32),
                    },
                }
            },
        }
    }
    return compress_params(params, keep=0.5, progress=False)


def test_linen_round_trip_with_metadata(rng, tmp_path):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    save_compressed(path, params, report=report, metadata={"source": "unit test"})
    loaded, info = load_compressed(path)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, loaded)
    assert loaded["params"]["embed"]["embedding"].dtype == ml_dtypes.bfloat16
    assert info.method == "svd" and info.keep == 0.5
    assert info.ranks == report.ranks and len(info.ranks) == 2
    assert info.report["layers"][0]["rank"] == report.layers[0].rank
    assert info.user == {"source": "unit test"}
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left behind
    # Any safetensors reader sees plain tensors and the metadata.
    header = safetensors.safe_open(str(path), framework="numpy").metadata()
    assert json.loads(header["ranks"]) == report.ranks and header["method"] == "svd"


def test_nnx_round_trip_into_template(rng, tmp_path):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([SVDLinear(20, 30, 4, rngs=rngs), SVDLinear(30, 10, 3, use_bias=False, rngs=rngs)])

    def random_model():
        model = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
        for _, param in nnx.iter_graph(model):
            if isinstance(param, nnx.Param):
                param.set_value(jnp.asarray(rng.standard_normal(param.shape), jnp.float32))
        return model

    model = random_model()
    state = nnx.state(model)
    path = tmp_path / "nnx.safetensors"
    save_compressed(path, state)
    fresh = random_model()
    loaded, info = load_compressed(path, like=nnx.state(fresh))
    assert info.method == "none" and info.ranks == {"layers/0": 4, "layers/1": 3}
    assert isinstance(loaded, nnx.State) and isinstance(loaded["layers"][1]["u"], nnx.Param)
    assert jax.tree.structure(loaded) == jax.tree.structure(nnx.state(fresh))
    nnx.update(fresh, loaded)
    x = jnp.asarray(rng.standard_normal((5, 20)), jnp.float32)
    np.testing.assert_array_equal(fresh.layers[1](fresh.layers[0](x)), model.layers[1](model.layers[0](x)))
    # Without a template the int keys of the NNX list survive as ints.
    plain, _ = load_compressed(path)
    assert set(plain["layers"]) == {0, 1}


def test_overwrite_is_atomic_when_saving_fails_mid_write(rng, tmp_path, monkeypatch):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    save_compressed(path, params, report=report)
    before = path.read_bytes()
    seen_temporaries = []

    def write_half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 1000)  # a partly written file under the temporary name
        seen_temporaries.append(sorted(os.listdir(tmp_path)))
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_compressed(path, params, report=report, overwrite=True)
    assert len(seen_temporaries) == 1 and len(seen_temporaries[0]) == 2  # the temporary existed mid-write
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["model.safetensors"]


def test_existing_file_is_kept_unless_overwrite(rng, tmp_path):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"the user's own file")
    with pytest.raises(FileExistsError, match="model.safetensors.*overwrite=True"):
        save_compressed(path, params, report=report)
    assert path.read_bytes() == b"the user's own file"
    save_compressed(path, params, report=report, overwrite=True)
    assert load_compressed(path)[1].ranks == report.ranks


def test_no_clobber_check_and_publish_are_one_step(tmp_path):
    # Another writer publishes `path` while this one writes its temporary: this one must fail, not replace it.
    path = tmp_path / "model.safetensors"

    def write(temporary):
        path.write_bytes(b"the other writer's file")
        with open(temporary, "wb") as f:
            f.write(b"this writer's file")

    with pytest.raises(FileExistsError, match=r"model\.safetensors.*exists"):
        write_atomically(path, write, overwrite=False)
    assert path.read_bytes() == b"the other writer's file" and os.listdir(tmp_path) == ["model.safetensors"]
    write_atomically(path, write, overwrite=True)
    assert path.read_bytes() == b"this writer's file"


def test_concurrent_saves_without_overwrite_one_wins(rng, tmp_path):
    # Eight threads save different params to one path at the same instant, for several rounds: exactly one
    # succeeds per round, the others get FileExistsError, and the file holds the winner's tensors.
    writers = 8
    params = [{"w": rng.standard_normal((64, 33)).astype(np.float32)} for _ in range(writers)]
    for round_ in range(4):
        path = tmp_path / f"round{round_}.safetensors"
        barrier = threading.Barrier(writers)
        outcomes = [None] * writers

        def save(i, path=path, barrier=barrier, outcomes=outcomes):
            barrier.wait()
            try:
                save_compressed(path, params[i])
                outcomes[i] = "saved"
            except FileExistsError:
                outcomes[i] = "exists"

        threads = [threading.Thread(target=save, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["exists"] * (writers - 1) + ["saved"], outcomes
        loaded, _ = load_compressed(path)
        np.testing.assert_array_equal(loaded["w"], params[outcomes.index("saved")]["w"])
    assert sorted(os.listdir(tmp_path)) == [f"round{i}.safetensors" for i in range(4)]  # no temporaries left


def test_concurrent_saves_in_two_processes_one_wins(rng, tmp_path):
    path = tmp_path / "model.safetensors"
    start_at = time.time() + 8  # both processes import JAX first, then save at the same instant
    script = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from jax_neuronmm.compress import save_compressed
        value = np.full((256, 257), float(sys.argv[1]), np.float32)
        time.sleep(max(0.0, {start_at} - time.time()))
        try:
            save_compressed({str(path)!r}, {{"w": value}})
            print("saved")
        except FileExistsError:
            print("exists")
    """)
    runs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, text=True) for i in (1, 2)]
    outputs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert sorted(outputs) == ["exists", "saved"], outputs
    loaded, _ = load_compressed(path)
    assert np.all(loaded["w"] == float(1 + outputs.index("saved")))


@pytest.mark.parametrize("bad", ["", "dir_path", "trailing/"])
def test_bad_save_paths_are_named(rng, tmp_path, bad, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir_path").mkdir()
    (tmp_path / "trailing").mkdir()
    error = IsADirectoryError if bad == "dir_path" else ValueError
    expected = "is a directory, expected a file path" if bad == "dir_path" else "expected a file path"
    for overwrite in (False, True):
        with pytest.raises(error, match=expected):
            save_compressed(bad, {"w": np.ones(3, np.float32)}, overwrite=overwrite)
    assert sorted(os.listdir(tmp_path)) == ["dir_path", "trailing"]  # no temporary left anywhere
    assert os.listdir(tmp_path / "dir_path") == [] and os.listdir(tmp_path / "trailing") == []


@pytest.mark.parametrize(
    "leaf",
    [np.array([object(), 1]), np.array(["a", "b"]), np.array([1 + 2j]), np.zeros(2, dtype=[("a", "f4")])],
    ids=["object", "str", "complex", "structured"],
)
def test_leaves_that_are_not_number_arrays_are_named(tmp_path, leaf):
    with pytest.raises(TypeError, match=r"params leaf 'layer/odd' has dtype .*expected an array of numbers"):
        save_compressed(tmp_path / "x.safetensors", {"layer": {"odd": leaf, "w": np.ones(2, np.float32)}})
    assert os.listdir(tmp_path) == []


def test_saved_file_gets_the_umask_mode_not_0600(rng, tmp_path):
    params, report = compressed_linen(rng)
    previous = os.umask(0o022)
    try:
        save_compressed(tmp_path / "model.safetensors", params, report=report)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "model.safetensors").st_mode) == 0o644


def test_temporary_of_a_killed_save_is_removed_by_the_next_save(rng, tmp_path):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, signal
        from jax_neuronmm.compress.checkpoint import write_atomically
        def write(temporary):
            with open(temporary, "wb") as f:
                f.write(b"\\x00" * 100000)
            os.kill(os.getpid(), signal.SIGKILL)
        write_atomically({str(path)!r}, write)
    """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    leftovers = os.listdir(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].startswith(".model.safetensors.") and leftovers[0].endswith(".tmp")
    own = leftovers[0]
    host, pid = own.split(".")[-4:-2]
    # Files shaped like temporaries that this code did not write, or a writer that still runs, or another host's:
    # none is ours to remove.
    kept = [
        ".other.safetensors.1.ab.tmp",  # another file's name
        "notes.tmp",
        ".model.safetensors.99999999.abcdef01.tmp",  # the user's (or another tool's), with a dead pid in it
        own.replace(f".{pid}.", f".{os.getpid()}."),  # ours, but its writer (this process) runs
        own.replace(f".{host}.", ".another-host."),  # written on another machine sharing the directory
    ]
    for name in kept:
        (tmp_path / name).write_bytes(b"not ours to remove")
    save_compressed(path, params, report=report)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["model.safetensors"])


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_compressed(tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError, match="directory"):
        save_compressed(tmp_path / "no_dir" / "x.safetensors", {"a": np.ones(3)})


def test_corrupt_tensor_bytes_fail_the_checksum(rng, tmp_path):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    save_compressed(path, params, report=report)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a byte inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_compressed(path)


def test_truncated_and_garbage_files(rng, tmp_path):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    save_compressed(path, params, report=report)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file"):
        load_compressed(path)
    path.write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file"):
        load_compressed(path)


def test_foreign_safetensors_file(tmp_path):
    path = tmp_path / "hf.safetensors"
    safetensors.numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="not written by save_compressed"):
        load_compressed(path)


def test_tampered_metadata(rng, tmp_path):
    params, report = compressed_linen(rng)
    tensors = {"a/u": np.ones((4, 2), np.float32), "a/v": np.ones((2, 3), np.float32)}
    path = tmp_path / "x.safetensors"
    save_compressed(path, {"a": {"u": tensors["a/u"], "v": tensors["a/v"]}})
    header = safetensors.safe_open(str(path), framework="numpy").metadata()
    header["ranks"] = json.dumps({"a": 5})
    safetensors.numpy.save_file(tensors, str(path), metadata=header)
    with pytest.raises(CheckpointError, match="metadata checksum mismatch"):
        load_compressed(path)
    # Behind the metadata checksum (re-sealed, as a forger would), each entry is still checked.
    header[HEADER_SHA256] = header_digest(header)
    safetensors.numpy.save_file(tensors, str(path), metadata=header)
    with pytest.raises(CheckpointError, match="recorded ranks"):
        load_compressed(path)
    # A tensor added to the file: the error names it (not every tensor).
    header["ranks"] = json.dumps({"a": 2})
    header[HEADER_SHA256] = header_digest(header)
    safetensors.numpy.save_file(dict(tensors, **{"a/extra": np.zeros(3, np.float32)}), str(path), metadata=header)
    with pytest.raises(CheckpointError, match=r"not in the recorded names: \['a/extra'\]$"):
        load_compressed(path)
    safetensors.numpy.save_file({"a/u": tensors["a/u"]}, str(path), metadata=header)
    with pytest.raises(CheckpointError, match=r"recorded tensors missing from the file: \['a/v'\]$"):
        load_compressed(path)
    del header["sha256"]
    header[HEADER_SHA256] = header_digest(header)
    safetensors.numpy.save_file(tensors, str(path), metadata=header)
    with pytest.raises(CheckpointError, match="damaged metadata"):
        load_compressed(path)


def test_template_mismatch_is_reported(rng, tmp_path):
    params, report = compressed_linen(rng)
    path = tmp_path / "model.safetensors"
    save_compressed(path, params, report=report)
    template = jax.tree.map(lambda a: a, params)
    template["params"]["layers_0"]["mlp"]["up_proj"]["u"] = jnp.zeros((24, 3), jnp.float32)
    template["params"]["extra"] = {"w": jnp.zeros(2)}
    del template["params"]["embed"]
    with pytest.raises(CheckpointError) as error:
        load_compressed(path, like=template)
    message = str(error.value)
    assert "missing tensors ['params/extra/w']" in message
    assert "unexpected tensors ['params/embed/embedding']" in message
    assert "params/layers_0/mlp/up_proj/u: file has float32" in message and "expected float32[24, 3]" in message


def test_report_must_match_params(rng, tmp_path):
    params, report = compressed_linen(rng)
    other, other_report = compress_params(
        {"mlp": {"kernel": np.ones((8, 8), np.float32) + np.eye(8)}}, rank=2, progress=False
    )
    with pytest.raises(ValueError, match="report ranks"):
        save_compressed(tmp_path / "x.safetensors", params, report=other_report)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        save_compressed(tmp_path / "x.safetensors", params, metadata={"n": 3})


def two_layers(rng):
    """Two layers whose factors have the same (ragged) shapes, so exchanging them keeps every shape valid."""
    return {
        "layers": [
            {"up_proj": {"u": rng.standard_normal((13, 3)).astype(np.float32), "v": rng.standard_normal((3, 7))}}
            for _ in range(2)
        ]
    }


def assert_loads_as(path, params):
    loaded, _ = load_compressed(path)
    for index in range(2):
        for name in ("u", "v"):
            expected = params["layers"][index]["up_proj"][name]
            np.testing.assert_array_equal(loaded["layers"][index]["up_proj"][name], expected)


def test_swapped_tensor_paths_are_refused(rng, tmp_path):
    # Swapping the `paths` entries of two same-shaped tensors used to load the layers exchanged, every checksum
    # passing: the checksums did not cover which tensor a path named.
    params = two_layers(rng)
    path = tmp_path / "x.safetensors"
    save_compressed(path, params)
    good = path.read_bytes()
    first, second = "layers/0/up_proj/u", "layers/1/up_proj/u"
    edit_metadata(path, lambda metadata: swap_json_entries(metadata, "paths", first, second), reseal=False)
    with pytest.raises(CheckpointError, match="metadata checksum mismatch: its metadata was edited"):
        load_compressed(path)
    path.write_bytes(good)
    edit_metadata(path, lambda metadata: swap_json_entries(metadata, "paths", first, second), reseal=True)
    with pytest.raises(CheckpointError, match=f"tensor '{first}' is recorded at key path '{second}'"):
        load_compressed(path)

    # The two tensors' data exchanged together with their checksums: each checksum covers its tensor's name.
    def exchange(header):
        swap(header, first, second)
        swap_json_entries(header["__metadata__"], "sha256", first, second)

    path.write_bytes(good)
    rewrite_header(path, exchange, reseal=True)
    with pytest.raises(
        CheckpointError, match=rf"checksum mismatch \(corrupt data\) in tensors \['{first}', '{second}'\]"
    ):
        load_compressed(path)
    path.write_bytes(good)
    assert_loads_as(path, params)


def test_stripped_metadata_checksum_is_refused(rng, tmp_path):
    path = tmp_path / "x.safetensors"
    save_compressed(path, two_layers(rng), metadata={"note": "kept"})
    good = path.read_bytes()
    edit_metadata(path, lambda metadata: metadata.pop(HEADER_SHA256), reseal=False)
    with pytest.raises(CheckpointError, match=f"has no '{HEADER_SHA256}' in its metadata"):
        load_compressed(path)
    # Stripping the checksum and editing an entry: still refused (not a downgrade to no checks).
    path.write_bytes(good)
    edit_metadata(path, lambda metadata: metadata.update({HEADER_SHA256: "0" * 64}), reseal=False)
    with pytest.raises(CheckpointError, match="metadata checksum mismatch"):
        load_compressed(path)
    path.write_bytes(good)
    edit_metadata(path, lambda metadata: metadata.update({"user": json.dumps({"note": "edited"})}), reseal=False)
    with pytest.raises(CheckpointError, match="metadata checksum mismatch"):
        load_compressed(path)


def downgrade_to_v1(params):
    """An edit that turns a current file into what save_compressed wrote before: format 1, tensor checksums
    without the name, no metadata checksum."""
    tensors = {
        f"layers/{index}/up_proj/{name}": np.asarray(layer["up_proj"][name])
        for index, layer in enumerate(params["layers"])
        for name in ("u", "v")
    }

    def edit(metadata):
        metadata["format"] = FORMAT_V1
        metadata["sha256"] = json.dumps({name: _digest(array, None) for name, array in tensors.items()})
        del metadata[HEADER_SHA256]

    return edit


def test_earlier_format_loads_only_with_its_checksums(rng, tmp_path):
    params = two_layers(rng)
    path = tmp_path / "x.safetensors"
    save_compressed(path, params)
    edit_metadata(path, downgrade_to_v1(params), reseal=False)
    assert_loads_as(path, params)
    v1 = path.read_bytes()
    # Its tensor checksums do not cover the name, so a path that is not its tensor's name is refused by itself.
    edit_metadata(
        path,
        lambda metadata: swap_json_entries(metadata, "paths", "layers/0/up_proj/v", "layers/1/up_proj/v"),
        reseal=False,
    )
    with pytest.raises(
        CheckpointError, match="tensor 'layers/0/up_proj/v' is recorded at key path 'layers/1/up_proj/v'"
    ):
        load_compressed(path)
    path.write_bytes(v1)
    edit_metadata(path, lambda metadata: metadata.pop("sha256"), reseal=False)
    with pytest.raises(CheckpointError, match="damaged metadata"):
        load_compressed(path)

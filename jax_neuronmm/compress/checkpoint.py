"""Save and load (compressed) parameter trees as one safetensors file, with checksums and compression metadata.

Layout: one tensor per leaf, named by its "/"-joined key path. The safetensors header metadata (string → string)
holds:
  format       "jax_neuronmm.params/2"
  method, keep compression method ("svd" | "whitened" | "none") and kept fraction (JSON, null if by rank)
  ranks        JSON {layer path: rank}, one entry per sub-tree holding both `u` and `v`
  paths        JSON {tensor name: [key, ...]}, so int keys (NNX lists) survive the round trip
  sha256       JSON {tensor name: hex digest of the JSON-quoted name + "|dtype|shape|" + the tensor's bytes}
  report       JSON of the `CompressionReport` (when one was given)
  user         JSON of the caller's own string metadata
  header_sha256  hex digest of every other metadata entry (canonical JSON of the sorted items)
Integrity fails closed: a file of this format without its header or tensor checksums is refused; a tensor's name
is its "/"-joined key path and is inside its checksum, so swapping two tensors' `paths` entries (or their data and
checksums) is refused too. Files of the earlier "jax_neuronmm.params/1" format (tensor checksums without the
name, no header checksum) are still read: their names must equal their joined paths and every tensor checksum
must be present and match.
fp8 weights (see compress/quantize.py) are stored as safetensors F8_E4M3 (float8_e4m3fn bits, values within
Trainium's ±240) next to their float32 scales (`u_scale`, `v_scale`, `kernel_scale` beside `u`, `v`, `kernel`),
checksummed like every tensor; saving and loading both refuse fp8 values beyond ±240 or NaN and non-finite scales
(`fp8_content_problems`).
Files are written to a temporary file in the target directory (`write_atomically`) and moved into place in one
step, so a crash never leaves a half-written checkpoint under the final name; an existing file is replaced only
when the caller says `overwrite=True` (otherwise the temporary is hard-linked into place, which fails when the
name exists, so of two concurrent saves one wins and the other gets FileExistsError). Loading verifies every
checksum. No pickle anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import secrets
import socket
import struct
from collections.abc import Callable, Mapping

import numpy as np
import safetensors
import safetensors.numpy

from jax_neuronmm.compress import tree
from jax_neuronmm.compress.params import CompressionReport
from jax_neuronmm.shapes import FP8_DTYPE, FP8_MAX, FP8_RECIPE

FP8_SAFETENSORS_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn

FORMAT = "jax_neuronmm.params/2"
# What save_compressed wrote before the header checksum and name-bound tensor checksums; still read.
FORMAT_V1 = "jax_neuronmm.params/1"
HEADER_SHA256 = "header_sha256"


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, is not ours, or does not match what the caller expected."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """The metadata read back by `load_compressed`."""

    method: str
    keep: float | None
    ranks: dict[str, int]
    report: dict | None
    user: dict[str, str]


def save_compressed(
    path,
    params,
    *,
    report: CompressionReport | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> None:
    """Write params (Linen dicts, NNX State, lists; leaves numpy/JAX arrays or NNX Variables) to `path`.

    `report` (from `compress_params`) supplies method and keep and must agree with the ranks found in params;
    without it the file records method "none". `metadata` is extra string → string data kept under "user".
    An existing file at `path` is replaced (atomically) only with `overwrite=True`; otherwise FileExistsError, also
    when another process saves to `path` at the same time and publishes first. Raises ValueError for an empty path
    or one ending in a separator, IsADirectoryError when `path` is a directory, TypeError for a leaf that is not an
    array of numbers or booleans (object, string, complex arrays).
    """
    path = _file_path(path, "cannot save checkpoint")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save checkpoint {path!r}: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot save checkpoint {path!r}: it is a directory, expected a file path")
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"cannot save checkpoint {path!r}: the file exists (pass overwrite=True to replace it)")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"metadata must map str to str, got {dict(metadata)!r}")

    tensors, paths = {}, {}
    for keys, leaf in tree.iter_leaves(params):
        name = tree.join(keys)
        value = tree.unwrap(leaf)
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"params leaf {name!r} is {type(value).__name__}, expected an array")
        if name in tensors:
            raise ValueError(f"two params leaves share the tensor name {name!r} (keys {paths[name]} and {list(keys)})")
        array = np.require(np.asarray(value), requirements="C")  # keeps 0-d arrays 0-d
        if array.dtype.kind in "OUSMmc" or array.dtype.fields is not None:
            raise TypeError(
                f"params leaf {name!r} has dtype {array.dtype}, expected an array of numbers or booleans "
                "(bool, int, uint, float types)"
            )
        tensors[name] = array
        paths[name] = [key if isinstance(key, int) else str(key) for key in keys]
    if not tensors:
        raise ValueError("params has no array leaves to save")
    problems = fp8_content_problems(paths, tensors)
    if problems:
        raise ValueError(f"params leaves that Trainium cannot use: {'; '.join(problems)}; {FP8_RECIPE}")

    ranks = _ranks(paths, tensors)
    # A report's rank None is a projection left dense: it has a kernel, no factors.
    if report is not None and {path: r for path, r in report.ranks.items() if r is not None} != ranks:
        raise ValueError(f"report ranks {report.ranks} do not match the u/v factors in params {ranks}")
    header = {
        "format": FORMAT,
        "method": report.method if report is not None else "none",
        "keep": json.dumps(report.keep if report is not None else None),
        "ranks": json.dumps(ranks),
        "paths": json.dumps(paths),
        "sha256": json.dumps({name: _digest(array, name) for name, array in tensors.items()}),
        "user": json.dumps(dict(metadata or {})),
    }
    if report is not None:
        header["report"] = json.dumps(report.to_dict())
    header[HEADER_SHA256] = header_digest(header)

    write_atomically(
        path,
        lambda temporary: safetensors.numpy.save_file(tensors, temporary, metadata=header),
        overwrite=overwrite,
    )


def _file_path(path, what: str) -> str:
    path = os.fspath(path)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if not path or path.endswith((os.sep, "/")) or os.path.basename(path) in ("", ".", ".."):
        raise ValueError(f"{what} {path!r}: expected a file path (a non-empty file name)")
    return path


# Temporaries are named ".<name>.<TAG>.<host>.<pid>.<random>.tmp": the tag and the host keep the stale-temporary
# cleanup to files this code wrote on this machine, the pid tells whether their writer still runs.
_TEMPORARY_TAG = "jax_neuronmm-partial"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def write_atomically(path, write: Callable[[str], None], *, overwrite: bool = True) -> None:
    """Calls write(temporary) on a fresh file next to `path`, fsyncs it and moves it to `path` in one step.

    The temporary file is created with the mode a normal new file gets (0666 minus the umask, so a process under
    another user can read a checkpoint when the umask allows), named ".<name>.jax_neuronmm-partial.<host>.<pid>.
    <random>.tmp". If `write` fails it is removed; temporaries that a killed earlier save of the same `path` on this
    host left behind (their process is gone) are removed first, and no other file.

    overwrite=True replaces `path` if it exists (os.replace). overwrite=False publishes with os.link, which fails
    when `path` exists, so the no-clobber check and the publish are one atomic step: FileExistsError if `path`
    exists or another writer published first. (Where the file system has no hard links, `path` is first claimed
    with O_EXCL and then replaced: still never clobbered, though readers may briefly see an empty file.)
    """
    path = _file_path(path, "cannot write")
    directory, name = os.path.split(os.path.abspath(path))
    _remove_stale_temporaries(directory, name)
    temporary = os.path.join(directory, f".{name}.{_TEMPORARY_TAG}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, unlike mkstemp
    try:
        normal_mode = os.stat(temporary).st_mode
        write(temporary)
        os.chmod(temporary, normal_mode)  # writers such as safetensors' may recreate the file as 0600
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        if overwrite:
            os.replace(temporary, path)
        else:
            _publish_new(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _publish_new(temporary: str, path: str) -> None:
    """Moves `temporary` to `path`, which must not exist (FileExistsError), in one step."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise FileExistsError(
            f"cannot write {path!r}: the file exists (another writer may have published it first); "
            "pass overwrite=True to replace it"
        ) from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        try:  # no hard links here: claim the name, then replace our own placeholder
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            raise FileExistsError(
                f"cannot write {path!r}: the file exists; pass overwrite=True to replace it"
            ) from None
        os.replace(temporary, path)
        return
    os.unlink(temporary)


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Removes this host's ".<name>.jax_neuronmm-partial.<host>.<pid>.<hex>.tmp" files in `directory` whose writing
    process no longer runs."""
    pattern = re.compile(rf"\.{re.escape(name)}\.{_TEMPORARY_TAG}\.{re.escape(_host())}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    for entry in os.listdir(directory):
        match = pattern.fullmatch(entry)
        if match and not _process_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):  # another save may have removed it meanwhile
                os.unlink(os.path.join(directory, entry))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, under another user
        return True
    return True


def load_compressed(path, *, like=None):
    """Read a checkpoint written by `save_compressed`, verifying its metadata checksum and every tensor's checksum.

    Args:
      path: the safetensors file.
      like: optional template tree (e.g. `nnx.state(svd_model)` or Linen variables of the compressed model). When
        given, the file must hold exactly its leaves with the same shapes and dtypes, and the result is returned in
        the template's containers (NNX Variables, JAX arrays); otherwise nested dicts of numpy arrays.

    Returns:
      (params, CheckpointInfo).

    Raises:
      FileNotFoundError: no file at path.
      CheckpointError (a ValueError): unreadable/corrupt file, a missing or mismatched checksum (metadata or
        tensor), a tensor path that is not its name, not written by `save_compressed`, or not matching `like`.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        with safetensors.safe_open(path, framework="numpy") as reader:
            header = reader.metadata() or {}
            if header.get("format") not in (FORMAT, FORMAT_V1):
                raise CheckpointError(
                    f"checkpoint {path!r} was not written by save_compressed: format={header.get('format')!r}, "
                    f"expected {FORMAT!r} (or the earlier {FORMAT_V1!r})"
                )
            fp8_names = [n for n in reader.keys() if reader.get_slice(n).get_dtype() == FP8_SAFETENSORS_DTYPE]
            tensors = {name: reader.get_tensor(name) for name in reader.keys() if name not in fp8_names}
        tensors.update(_read_fp8(path, fp8_names))
    except CheckpointError:
        raise
    except Exception as error:  # safetensors raises its own error types for damaged headers / truncated data
        raise CheckpointError(f"checkpoint {path!r} is corrupt or not a safetensors file: {error}") from error

    _check_header_digest(header, path)
    try:
        digests, paths, ranks = (json.loads(header[key]) for key in ("sha256", "paths", "ranks"))
        info = CheckpointInfo(
            method=header["method"],
            keep=json.loads(header["keep"]),
            ranks=ranks,
            report=json.loads(header["report"]) if "report" in header else None,
            user=json.loads(header["user"]),
        )
    except (KeyError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {path!r} has damaged metadata ({error!r})") from error
    if set(digests) != set(tensors) or set(paths) != set(tensors):
        extra = sorted(name for name in tensors if name not in digests or name not in paths)
        missing = sorted((set(digests) | set(paths)) - set(tensors))
        problems = [f"tensors not in the recorded names: {extra}"] if extra else []
        problems += [f"recorded tensors missing from the file: {missing}"] if missing else []
        raise CheckpointError(f"checkpoint {path!r}: " + "; ".join(problems))
    _check_paths(paths, path)
    bound = header["format"] == FORMAT  # v1 checksums do not cover the name
    corrupt = [name for name, array in tensors.items() if _digest(array, name if bound else None) != digests[name]]
    if corrupt:
        raise CheckpointError(f"checkpoint {path!r}: checksum mismatch (corrupt data) in tensors {corrupt}")
    if _ranks(paths, tensors) != info.ranks:
        raise CheckpointError(f"checkpoint {path!r}: recorded ranks {info.ranks} do not match the u/v tensors")
    problems = fp8_content_problems(paths, tensors)
    if problems:
        raise CheckpointError(f"checkpoint {path!r}: fp8 tensors that Trainium cannot use: {'; '.join(problems)}")

    flat = {tuple(paths[name]): array for name, array in tensors.items()}
    if like is None:
        return tree.nest(flat), info
    return _fill_like(like, flat, path), info


def header_digest(header: Mapping[str, str]) -> str:
    """sha256 of every metadata entry but HEADER_SHA256 itself, as canonical JSON of the sorted items."""
    entries = sorted((key, value) for key, value in header.items() if key != HEADER_SHA256)
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def _check_header_digest(header: Mapping[str, str], path: str) -> None:
    """CheckpointError unless a current-format header carries HEADER_SHA256 and it matches: stripping or editing
    any entry (a copied file's checksum, a tensor's path) is refused rather than trusted."""
    if header["format"] != FORMAT:
        return
    if HEADER_SHA256 not in header:
        raise CheckpointError(
            f"checkpoint {path!r} has no {HEADER_SHA256!r} in its metadata, which save_compressed always writes: "
            "its metadata was stripped or edited; refusing to load it unchecked"
        )
    if header_digest(header) != header[HEADER_SHA256]:
        raise CheckpointError(
            f"checkpoint {path!r}: metadata checksum mismatch: its metadata was edited after it was saved "
            f"({HEADER_SHA256!r} does not match the other entries)"
        )


def _check_paths(paths: Mapping[str, object], path: str) -> None:
    """CheckpointError unless every tensor's recorded key path is a list of str/int keys whose "/"-join is the
    tensor's name: the name is what the checksum covers, so a path that disagrees would load verified data under
    another key."""
    for name, keys in paths.items():
        if not isinstance(keys, list) or not all(isinstance(key, (str, int)) for key in keys):
            raise CheckpointError(f"checkpoint {path!r} has damaged metadata: paths[{name!r}] is {keys!r}")
        if tree.join(keys) != name:
            raise CheckpointError(
                f"checkpoint {path!r}: tensor {name!r} is recorded at key path {tree.join(keys)!r}; a tensor's "
                "path must be its name (the metadata was edited)"
            )


def _read_fp8(path: str, names: list[str]) -> dict[str, np.ndarray]:
    """The F8_E4M3 tensors `names`, read from the file's bytes as float8_e4m3fn: safetensors' numpy reader has no
    float8 type (numpy lacks one; ml_dtypes provides it). Layout: 8-byte header length, JSON header, data."""
    if not names:
        return {}
    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
        found = {}
        for name in names:
            start, end = header[name]["data_offsets"]
            file.seek(8 + header_size + start)
            data = file.read(end - start)
            found[name] = np.frombuffer(data, dtype=FP8_DTYPE).reshape(header[name]["shape"]).copy()
    return found


def _fill_like(like, flat: dict[tuple, np.ndarray], path: str):
    """The template `like` with every leaf replaced by the loaded array of the same key path."""
    template = {keys: tree.unwrap(leaf) for keys, leaf in tree.iter_leaves(like)}
    problems = fit_problems(template, flat, check_dtype=True)
    if problems:
        raise CheckpointError(f"checkpoint {path!r} does not match the template: " + "; ".join(problems))
    return tree.rebuild(like, lambda keys, leaf: [(keys[-1] if keys else None, tree.wrap_like(leaf, flat[keys]))])


def fit_problems(expected: Mapping[tuple, object], found: Mapping[tuple, np.ndarray], *, check_dtype: bool):
    """Why tensors `found` (key path -> array) do not fit `expected` (key path -> anything with .shape/.dtype).

    Lists missing and unexpected key paths (the first five of each, with the count) and shape (and, with
    check_dtype, dtype) mismatches; an empty list means they fit.
    """
    problems = []
    missing = [tree.join(keys) for keys in expected if keys not in found]
    unexpected = [tree.join(keys) for keys in found if keys not in expected]
    if missing:
        problems.append(f"missing tensors {missing[:5]} ({len(missing)} in all)")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]} ({len(unexpected)} in all)")
    for keys, leaf in expected.items():
        if keys not in found:
            continue
        got = found[keys]
        same_shape = tuple(leaf.shape) == tuple(got.shape)
        if check_dtype and not (same_shape and np.dtype(leaf.dtype) == got.dtype):
            problems.append(
                f"{tree.join(keys)}: file has {got.dtype}{list(got.shape)}, expected "
                f"{np.dtype(leaf.dtype)}{list(leaf.shape)}"
            )
        elif not same_shape:
            problems.append(f"{tree.join(keys)}: file has shape {list(got.shape)}, expected {list(leaf.shape)}")
    return problems


def _ranks(paths: Mapping[str, list], tensors: Mapping[str, np.ndarray]) -> dict[str, int]:
    """{layer path: rank} for each sub-tree holding both u [..., K, r] and v [..., r, N]."""
    by_keys = {tuple(keys): tensors[name] for name, keys in paths.items()}
    ranks = {}
    for keys, u in by_keys.items():
        if keys and keys[-1] == "u" and keys[:-1] + ("v",) in by_keys and u.ndim >= 2:
            ranks[tree.join(keys[:-1])] = int(u.shape[-1])
    return ranks


def fp8_content_problems(paths: Mapping[str, list], tensors: Mapping[str, np.ndarray]) -> list[str]:
    """What is wrong in the fp8 tensors (name -> array, key paths `paths`): values beyond ±240 or NaN, which
    Trainium's float8_e4m3 cannot hold (the device reads them as NaN), and NaN / ±inf in the float32 scales
    stored beside them (`<leaf>_scale`). A checksum proves only that the bytes are the ones written, so saving
    and loading both look at the values."""
    names = {tuple(keys): name for name, keys in paths.items()}
    problems = []
    for name, array in tensors.items():
        if array.dtype != FP8_DTYPE:
            continue
        count = np.count_nonzero(~(np.abs(array.astype(np.float32)) <= FP8_MAX))
        if count:
            problems.append(f"{name!r} holds {count} value(s) beyond ±{FP8_MAX:g} or NaN")
        keys = tuple(paths[name])
        scale = names.get(keys[:-1] + (f"{keys[-1]}_scale",))
        if scale is not None and tensors[scale].dtype.kind == "f":
            count = np.count_nonzero(~np.isfinite(tensors[scale]))
            if count:
                problems.append(f"{scale!r} (the scales of {name!r}) holds {count} NaN or ±inf value(s)")
    return problems


def _digest(array: np.ndarray, name: str | None) -> str:
    """sha256 of the tensor's name (JSON-quoted; None for the v1 format, whose checksums lack it), dtype, shape
    and bytes."""
    contiguous = np.require(array, requirements="C")
    prefix = "" if name is None else json.dumps(name) + "|"
    digest = hashlib.sha256(f"{prefix}{contiguous.dtype.str}|{list(contiguous.shape)}|".encode())
    digest.update(contiguous.reshape(-1).view(np.uint8))
    return digest.hexdigest()

"""AWS nki-library's dense MLP kernels ("dense (nkilib)") run unmodified on the emulator for the kernel report.

The kernels are imported at run time from a local checkout of aws-neuron/nki-library (`--nki_library`), inside
`nki_kernels.emulator.as_nki()`; nothing of theirs is copied here. nkilib's entry point `nkilib.core.mlp.mlp`
picks `mlp_tkg` (token generation) or `mlp_cte` (context encoding) from the shapes; the report calls the same
kernel it would pick, through `MLPParameters`, in count-only mode (timing only, no numerics).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback

import numpy as np

from nki_kernels import emulator


def check_checkout(checkout: str) -> str:
    """The checkout's nkilib source folder; ValueError naming --nki_library when it has none."""
    source = os.path.join(os.path.expanduser(checkout), "src", "nkilib_src")
    if not os.path.isdir(os.path.join(source, "nkilib")):
        raise ValueError(f"--nki_library: {checkout!r} has no src/nkilib_src/nkilib folder")
    return source


@contextlib.contextmanager
def _nkilib(source):
    """nkilib importable under the emulator's `nki`; its modules are dropped again afterwards."""
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    try:
        with emulator.as_nki():
            sys.path.insert(0, source)
            yield importlib.import_module
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name == "nkilib" or name.startswith("nkilib."):
                del sys.modules[name]


def dense_mlp_runs(source: str, t: int, h: int, i: int, dtype, force_cte: bool = False):
    """(kernel name, profiled runs) of nkilib's dense SiLU MLP on x [1, t, h], gate/up [h, i], down [i, h].

    The kernel is the one nkilib's `mlp` picks (`mlp_tkg` for few tokens, else `mlp_cte`), or `mlp_cte` with
    its documented `force_cte_mode` when force_cte. Raises whatever the kernel raises; `describe_failure`
    turns it into one line for the report.
    """
    with _nkilib(source) as load:
        parameters = load("nkilib.core.mlp.mlp_parameters")
        nl = emulator.language
        x = np.zeros((1, t, h), dtype)
        gate, up, down = np.zeros((h, i), dtype), np.zeros((h, i), dtype), np.zeros((i, h), dtype)
        holder = {}

        @emulator.jit
        def driver(x, gate, up, down):
            params = parameters.MLPParameters(
                hidden_tensor=x,
                gate_proj_weights_tensor=gate,
                up_proj_weights_tensor=up,
                down_proj_weights_tensor=down,
                force_cte_mode=force_cte,
            )
            name = "mlp_tkg" if parameters.is_mlp_tkg(params) else "mlp_cte"
            holder["name"] = name
            kernel = getattr(load(f"nkilib.core.mlp.{name}.{name}"), name)
            out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            result = kernel(params, out, None)
            return out if result is None else result[0]

        with emulator.count_only(), emulator.profile() as prof:
            driver(x, gate, up, down)
        return holder.get("name", "mlp") + (" (force_cte_mode)" if force_cte else ""), prof.runs


# mlp_cte tiles the tokens so that one token tile's up/gate outputs over the whole (per-core) intermediate size
# fit the 8 PSUM banks (8 x 2 KiB / 4 B = 4096 fp32 per partition); a larger intermediate gives it a zero-sized
# token tile, and its SBUF heap bounds the slice further for large hidden sizes. nkilib's MLPs are deployed
# tensor-parallel, each core holding a slice of the intermediate size: the report tries these slice widths.
SLICE_WIDTHS = (4096, 2048, 1024, 512)


def intermediate_shards(i: int, width: int) -> list[int]:
    """Split i into the fewest slices of at most `width`, multiples of 128 where i allows."""
    count = -(-i // width)
    blocks, rest = divmod(i, 128)
    sizes = [128 * (blocks // count + (k < blocks % count)) for k in range(count)]
    sizes[-1] += rest
    return sizes


def describe_failure(error: BaseException) -> str:
    """One line: the error and the innermost place it was raised (file:line)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message[:160]} (at {os.path.basename(frame.filename)}:{frame.lineno})"

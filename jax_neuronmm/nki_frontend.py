"""Calling an emulated `@nki.jit` kernel with JAX arrays, as one calls the real one.

The real `nki.jit` accepts jax Arrays (also under `jax.jit`) and runs the kernel
as part of the XLA computation. The emulator cannot import JAX, so this module
installs its array frontend: the kernel's outputs are inferred from a count-only
trace and the kernel runs on the host through `jax.pure_callback`.
"""

import jax
import numpy as np

from nki_kernels import emulator


def _is_array(value):
    return hasattr(value, "shape") and hasattr(value, "dtype")


def run_kernel_with_jax_arrays(kernel, grid, args, kwargs):
    """Runs `kernel[grid](*args, **kwargs)` with JAX array arguments through a host callback."""
    launch = kernel[grid] if grid else kernel
    positions = [i for i, a in enumerate(args) if _is_array(a)]
    specs = emulator.output_specs(
        kernel, [jax.ShapeDtypeStruct(a.shape, a.dtype) if _is_array(a) else a for a in args], kwargs, grid or None
    )
    result_shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]

    def on_host(*arrays):
        full = list(args)
        for i, array in zip(positions, arrays):
            full[i] = np.asarray(array)
        outputs = launch(*full, **kwargs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        return tuple(np.asarray(o, dtype=s.dtype) for o, s in zip(outputs, result_shapes))

    outputs = jax.pure_callback(on_host, tuple(result_shapes), *[args[i] for i in positions], vmap_method="sequential")
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def install():
    """Makes emulated kernels accept JAX arrays (a no-op when the real `nki` is in use)."""
    emulator.set_array_frontend(run_kernel_with_jax_arrays)

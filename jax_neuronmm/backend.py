"""Which implementation the primitives lower to: "xla", "emulator" or "neuron".

- "xla": the reference lowering (two dots, float32 accumulation) on any platform.
- "emulator": the NKI kernels, run on the bundled CPU emulator through a host
  callback (CPU platform only), with `profile()` counters and modeled latency.
- "neuron": the NKI kernels compiled for Trainium (platform "neuron"; needs the
  Neuron PJRT plugin and the real `nki` package).

The default, "auto", is "neuron" for computations placed on Trainium and "xla"
elsewhere. The choice is a JAX config option (`jax_neuronmm_backend`, env
JAX_NEURONMM_BACKEND) included in the jit cache key, so a function jitted under
one backend is lowered again when called under another.
"""

import contextlib

import jax

from jax_neuronmm._compat import define_string_enum_state, is_known_platform

BACKENDS = ("xla", "emulator", "neuron")

_backend = define_string_enum_state(
    "jax_neuronmm_backend",
    ["auto", *BACKENDS],
    "auto",
    "jax_neuronmm kernels: auto (neuron on Trainium, else xla), xla, emulator or neuron.",
)


def _check(name):
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"backend: got {name!r}; expected one of {('auto', *BACKENDS)}")
    if name == "neuron":
        require_neuron_toolchain()


def require_neuron_toolchain():
    """Raises a clear error unless both the Neuron JAX plugin and the real `nki` are present."""
    from nki_kernels.binding import USING_EMULATOR

    missing = []
    if not is_known_platform("neuron"):
        missing.append("the Neuron PJRT plugin (jax-neuronx / libneuronxla: JAX knows no 'neuron' platform)")
    if USING_EMULATOR:
        missing.append("AWS's `nki` package")
    if missing:
        raise RuntimeError(
            "backend 'neuron' needs " + " and ".join(missing) + ". Install the `neuron` extra from AWS's Neuron "
            "package repository on a Trainium instance, or use backend 'xla' or 'emulator'."
        )


def set_backend(name):
    """Sets the backend for this process ("auto", "xla", "emulator" or "neuron")."""
    _check(name)
    jax.config.update("jax_neuronmm_backend", name)


@contextlib.contextmanager
def use_backend(name):
    """Context manager: primitives bound and jitted functions called inside use backend `name`."""
    _check(name)
    with _backend(name):
        yield


def get_backend():
    """The configured backend name, "auto" included."""
    return _backend.value


def effective_backend(platform):
    """The backend a computation lowered for `platform` ("cpu", "neuron", ...) uses."""
    name = _backend.value
    if name == "auto":
        return "neuron" if platform == "neuron" else "xla"
    if name == "neuron" and platform != "neuron":
        raise RuntimeError(
            f"backend 'neuron' was selected but this computation is lowered for platform {platform!r}; put it on "
            "a Neuron device (jax.devices('neuron')) or use backend 'xla' or 'emulator'."
        )
    if name == "emulator" and platform != "cpu":
        raise RuntimeError(
            f"backend 'emulator' runs kernels on the host CPU; this computation is lowered for "
            f"platform {platform!r}. Use jax.devices('cpu') or backend 'xla'."
        )
    return name

"""NKI kernels for jax_neuronmm and the CPU emulator they run on when the Neuron toolchain is absent.

Kernels import `nki`, `nl`, `nisa` from `nki_kernels.binding`. This package never imports JAX.
"""

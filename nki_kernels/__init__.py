"""NKI kernels for jax_neuronmm and the CPU emulator they run on when the Neuron toolchain is absent.

Kernels import `nki`, `nl`, `nisa` from `nki_kernels.binding` (never the emulator directly). The JAX side asks
`dispatch` (plans, launch target), `activations`, `hardware` and `ranks`. This package never imports JAX or
jax_neuronmm; tests/test_import_graph.py checks both rules.
"""

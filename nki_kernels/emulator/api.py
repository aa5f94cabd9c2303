"""The emulator's stand-in for the top-level `nki` package: jit, simulate, language, isa, typing."""

import numpy as np

from . import collectives, isa, language
from . import nki_typing as typing
from .kernel import Kernel, jit, simulate

dtype = np.dtype  # annotations such as `output_dtype: nki.dtype`
__nki_emulator__ = True  # lets the binding tell this module from the real `nki`

__all__ = ["Kernel", "collectives", "dtype", "isa", "jit", "language", "simulate", "typing"]

"""The emulator's stand-in for the top-level `nki` package: jit, simulate, language, isa, typing."""

from . import isa, language
from . import nki_typing as typing
from .kernel import Kernel, jit, simulate

__nki_emulator__ = True  # lets the binding tell this module from the real `nki`

__all__ = ["Kernel", "isa", "jit", "language", "simulate", "typing"]

"""Detect AWS's real `nki` package (not PyPI's placeholder, not this emulator standing in for it)."""

import importlib
import sys


def load_real_nki():
    """The real `nki` module when importable, else None (the PyPI placeholder raises ImportError)."""
    present = sys.modules.get("nki")
    if present is not None:
        return None if getattr(present, "__nki_emulator__", False) else present
    try:
        module = importlib.import_module("nki")
    except ImportError:
        return None
    if getattr(module, "__nki_emulator__", False) or not hasattr(module, "jit"):
        return None
    return module

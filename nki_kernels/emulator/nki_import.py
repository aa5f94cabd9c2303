"""`as_nki()`: make `import nki`, `nki.language`, `nki.isa`, `nki.isa.constants`, `nki.typing`,
`nki.collectives` resolve to the emulator."""

import contextlib
import sys

from . import api, collectives, isa, isa_constants, language, nki_typing
from ._real import load_real_nki

_MODULES = {
    "nki": api,
    "nki.language": language,
    "nki.isa": isa,
    "nki.isa.constants": isa_constants,
    "nki.typing": nki_typing,
    "nki.collectives": collectives,
}


@contextlib.contextmanager
def as_nki():
    """Inside the block, kernel files written for the real toolchain import the emulator; sys.modules is
    restored afterwards. Refuses (RuntimeError) when the real `nki` package is installed."""
    if load_real_nki() is not None:
        raise RuntimeError("as_nki(): the real `nki` package is installed; refusing to shadow it with the emulator")
    saved = {name: module for name, module in sys.modules.items() if name == "nki" or name.startswith("nki.")}
    sys.modules.update(_MODULES)
    try:
        yield api
    finally:
        for name in [n for n in sys.modules if n == "nki" or n.startswith("nki.")]:
            del sys.modules[name]
        sys.modules.update(saved)

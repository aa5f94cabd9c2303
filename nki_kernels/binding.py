"""What kernels import: `from nki_kernels.binding import nki, nl, nisa`.

The real `nki` package (AWS's Neuron repository) when it is importable, else the CPU emulator in
nki_kernels.emulator. PyPI's placeholder `nki` raises ImportError on import and so counts as absent.
"""

from nki_kernels.emulator._real import load_real_nki

_real = load_real_nki()
if _real is not None:
    import nki.isa as nisa
    import nki.language as nl

    nki = _real
    USING_EMULATOR = False
else:
    from nki_kernels.emulator import api as nki
    from nki_kernels.emulator import isa as nisa
    from nki_kernels.emulator import language as nl

    USING_EMULATOR = True

__all__ = ["USING_EMULATOR", "nki", "nisa", "nl"]

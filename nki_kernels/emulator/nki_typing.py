"""`nki.typing` on the emulator: `tensor` is the NKI tensor type (for annotations)."""

from .tensor import NkiTensor as tensor

__all__ = ["tensor"]

"""Static checks of the emulator package: no imports left unused (pyflakes)."""

import pathlib

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")

EMULATOR_DIR = pathlib.Path(__file__).resolve().parent.parent / "nki_kernels" / "emulator"


class _Collector:
    """A pyflakes reporter that keeps the messages instead of printing them."""

    def __init__(self):
        self.messages = []

    def unexpectedError(self, filename, message):
        self.messages.append(f"{filename}: could not check: {message}")

    def syntaxError(self, filename, message, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: could not check: {message}")

    def flake(self, message):
        self.messages.append(str(message))


def test_emulator_has_no_unused_imports():
    files = sorted(EMULATOR_DIR.glob("*.py"))
    assert len(files) > 5, files
    collector = _Collector()
    for path in files:
        pyflakes_api.checkPath(str(path), collector)
    unused = [m for m in collector.messages if "imported but unused" in m or "could not check" in m]
    assert not unused, "\n".join(unused)

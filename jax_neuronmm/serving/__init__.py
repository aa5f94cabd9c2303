"""Serving: continuous batching over a paged KV cache (`Engine`) behind an OpenAI-compatible HTTP server
(`python -m jax_neuronmm.serving`). FastAPI, uvicorn and jinja2 are the `serve` extra; only the server modules
import them."""

from jax_neuronmm.serving.engine import Engine, EngineOptions, Event, SamplingParams, StepRecord

__all__ = ["Engine", "EngineOptions", "Event", "SamplingParams", "StepRecord"]

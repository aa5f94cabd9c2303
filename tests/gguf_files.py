"""Small random GGUF files written with gguf.GGUFWriter the way llama.cpp's converter writes each architecture (its
tensor names, Llama's Q/K row permutation, Gemma's norms stored as w + 1, its metadata keys and tokenizer fields),
with tensors in the float and quantized types a real file mixes. Float and Q8_0/Q5_0 tensors come from
gguf.quants.quantize; the gguf package has no K-quant quantizer, so Q4_K/Q5_K/Q6_K tensors are random blocks with
valid fp16 scales."""

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# 256-wide rows so that the K-quants (256-value blocks) fit every matrix.
SHAPES = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, layers=3)
# Gemma 3: 6 layers make the 6th a global one; head_dim 256 because the file cannot state the query scaling, which
# llama.cpp takes as head_dim ** -0.5 and transformers as its config default 256 ** -0.5.
GEMMA3_SHAPES = dict(SHAPES, head_dim=256, layers=6)
# Types cycled over the matrices (embedding, projections, head): each appears in every model.
MATRIX_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.F16, Q.Q5_K, Q.BF16, Q.F32)


def _k_quant_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random blocks of a K-quant type whose fp16 super-block scales are small positive numbers."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    scales = rng.uniform(2e-4, 1e-3, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
        raw[..., -2:] = scales[..., :2]
    else:  # d, dmin, then scales and quants
        raw[..., :4] = scales
    return raw.reshape(rows, -1)


def random_tensor(rng, shape, qtype, *, offset=0.0, scale=0.08) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or floats to write, the float32 values they hold)."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = _k_quant_blocks(rng, *shape, qtype)
    else:
        values = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        data = gguf.quants.quantize(values, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(shape)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K permutation (rotate-half halves to interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- tokenizer vocabularies -------------------------------------------------------------------------------------

_PIECES = [
    "▁",
    "t",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "n",
    "m",
    "T",
    ",",
    ":",
    "he",
    "th",
    "the",
    "▁t",
    "▁the",
    "ll",
    "llo",
    "▁h",
    "▁he",
    "hello",
    "▁hello",
    "en",
    "▁w",
    "or",
    "orld",
    "▁world",
    "▁th",
    "▁then",
    "Th",
    "Then",
    "me",
    "▁theme",
    "nd",
    "▁end",
    "\n",
    "\n\n",
]


def _sentencepiece_vocab(rng, gemma: bool):
    """(tokens, scores, token types, special ids) of a small SentencePiece vocabulary with byte fallback."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    tokens += _PIECES + (["  ", "<start_of_turn>", "<custom>"] if gemma else ["▁▁", "<start_of_turn>", "<custom>"])
    types += [1] * (len(_PIECES) + 1) + [3, 4]
    scores = [0.0] * 260 + list(
        -np.arange(len(tokens) - 260, dtype=np.float32) - rng.uniform(0, 0.5, len(tokens) - 260)
    )
    return tokens, scores, types, dict(pad=0, eos=1, bos=2, unk=3)


def byte_level_vocab():
    """(tokens, merges, token types, special ids) of a small byte-level BPE vocabulary (Llama 3 style)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    alphabet = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "Ġ w",
        "o r",
        "or l",
        "orl d",
        "Ġw orld",
        "l l",
        "ll o",
        "he llo",
        "Ġ he",
        "Ġhe llo",
        "Ċ Ċ",
        "Ġthe n",
        "m e",
        "Ġthe me",
    ]
    tokens = alphabet + [m.replace(" ", "") for m in merges]
    tokens += ["<|begin_of_text|>", "<|end_of_text|>", "<start_of_turn>", "<custom>"]
    types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]
    n = len(tokens)
    return tokens, merges, types, dict(bos=n - 4, eos=n - 3)


def write_gguf(
    path, arch: str, *, tied: bool, bias: bool, tokenizer: str, seed: int, rope_freqs=None, overrides=None, empty=()
):
    """Writes a random GGUF model of `arch` to `path` the way llama.cpp lays it out (with `rope_freqs`, llama.cpp's
    table of per-frequency RoPE divisors, as tensor rope_freqs.weight). `overrides` {key without the architecture
    prefix: (value, GGUFValueType)} replaces metadata fields; tensors named in `empty` are written with no rows."""
    rng = np.random.default_rng(seed)
    s = GEMMA3_SHAPES if arch == "gemma3" else SHAPES
    writer = gguf.GGUFWriter(path, arch)
    vocab = _add_tokenizer(writer, rng, tokenizer, gemma=arch.startswith("gemma"))
    _add_hyperparameters(writer, arch, s, vocab)
    for key, (value, vtype) in (overrides or {}).items():
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    types_cycle = iter(MATRIX_TYPES * 10)
    # Llama's norms multiply by w; llama.cpp stores Gemma's (1 + w) norms as w + 1: both sit around 1 in the file.
    norm_offset = 1.0
    for name, shape, kind, heads in _tensor_list(arch, s, vocab, tied=tied, bias=bias):
        if name in empty:
            shape = (0, *shape[1:])
        if kind == "matrix":
            qtype = next(types_cycle)
            data, values = random_tensor(rng, shape, qtype)
            if heads is not None and arch == "llama":
                # Our reference values are in HF layout; the file holds them permuted. Permuting the quantized
                # rows keeps every block intact (a block never spans two rows).
                data = _permute(data, heads)
        else:
            qtype = Q.F32
            data, values = random_tensor(rng, shape, qtype, offset=norm_offset if kind == "norm" else 0.0, scale=0.3)
            if heads is not None and arch == "llama":
                data = _permute(data, heads)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer, rng, tokenizer: str, *, gemma: bool) -> int:
    """The tokenizer fields of a byte-level BPE ("gpt2") or SentencePiece ("llama") vocabulary; returns its size."""
    if tokenizer == "gpt2":
        tokens, merges, types, special = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe")
        writer.add_token_merges(merges)
        writer.add_add_bos_token(True)
    else:
        tokens, scores, types, special = _sentencepiece_vocab(rng, gemma)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_unk_token_id(special["unk"])
        writer.add_pad_token_id(special["pad"])
        if gemma:
            writer.add_add_bos_token(True)
            writer.add_add_space_prefix(False)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(special["bos"])
    writer.add_eos_token_id(special["eos"])
    return len(tokens)


def _add_hyperparameters(writer, arch: str, s: dict, vocab: int) -> None:
    """The architecture's shape, norm and RoPE fields as llama.cpp's converter writes them."""
    writer.add_context_length(64)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_block_count(s["layers"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6 if arch.startswith("gemma") else 1e-5)
    if arch == "llama":
        writer.add_rope_dimension_count(s["head_dim"])
        writer.add_rope_freq_base(10000.0)
        writer.add_vocab_size(vocab)
    else:
        writer.add_key_length(s["head_dim"])
        writer.add_value_length(s["head_dim"])
        writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(4)


def _tensor_list(arch: str, s: dict, vocab: int, *, tied: bool, bias: bool) -> list:
    """(name, shape, kind, heads) of every tensor of the file, in llama.cpp's names; heads: the row permutation's
    head count of Llama's Q/K tensors."""
    tensors = [
        ("token_embd.weight", (vocab, s["hidden"]), "matrix", None),
        ("output_norm.weight", (s["hidden"],), "norm", None),
    ]
    if not tied:
        tensors.append(("output.weight", (vocab, s["hidden"]), "matrix", None))
    q_out, kv_out = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (s["hidden"],), "norm", None),
            (b + "attn_q.weight", (q_out, s["hidden"]), "matrix", s["heads"]),
            (b + "attn_k.weight", (kv_out, s["hidden"]), "matrix", s["kv_heads"]),
            (b + "attn_v.weight", (kv_out, s["hidden"]), "matrix", None),
            (b + "attn_output.weight", (s["hidden"], q_out), "matrix", None),
            (b + "ffn_norm.weight", (s["hidden"],), "norm", None),
            (b + "ffn_gate.weight", (s["intermediate"], s["hidden"]), "matrix", None),
            (b + "ffn_up.weight", (s["intermediate"], s["hidden"]), "matrix", None),
            (b + "ffn_down.weight", (s["hidden"], s["intermediate"]), "matrix", None),
        ]
        if bias:
            tensors += [
                (b + f"attn_{p}.bias", (n,), "bias", h)
                for p, n, h in (
                    ("q", q_out, s["heads"]),
                    ("k", kv_out, s["kv_heads"]),
                    ("v", kv_out, None),
                    ("output", s["hidden"], None),
                )
            ]
        if arch == "gemma3":
            tensors += [
                (b + "attn_q_norm.weight", (s["head_dim"],), "norm", None),
                (b + "attn_k_norm.weight", (s["head_dim"],), "norm", None),
                (b + "post_attention_norm.weight", (s["hidden"],), "norm", None),
                (b + "post_ffw_norm.weight", (s["hidden"],), "norm", None),
            ]
    return tensors

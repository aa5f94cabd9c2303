"""Load a llama.cpp GGUF file (Llama, Gemma, Gemma 3, Qwen3) into our NNX models, with its tokenizer.

The `gguf` package (llama.cpp's own reader) reads the file and dequantizes every tensor to float32. The model
config is rebuilt from the GGUF metadata as an HF config dict, so the same `from_hf` of each family's config builds
it as for an HF checkpoint. Tensor names follow from our parameter paths (named like HF modules) through gguf's own
HF -> GGUF name map. Two llama.cpp conventions are undone here (Qwen3 files keep HF's layout and plain norms):

- Llama: the converter permutes the rows of Q and K (weights and biases) per head from HF's rotate-half layout to
  interleaved pairs (`(heads, 2, d/2) -> (heads, d/2, 2)`); we permute them back.
- Gemma (1, 2, 3): the converter stores every RMSNorm weight as `w + 1` (llama.cpp runs a plain `w * x` norm);
  our Gemma norms compute `(1 + w) * x` like HF, so 1 is subtracted.

GGUF stores a linear weight like PyTorch, [out, in] in numpy order; our kernels are [in, out].
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import gguf
import gguf.quants
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.gguf_tokenizer import gguf_tokenizer
from jax_neuronmm.models.hf_loading import model_from_config
from jax_neuronmm.models.layers import RopeConfig
from jax_neuronmm.models.validation import check_param_dtype

SUPPORTED_ARCHITECTURES = ("llama", "gemma", "gemma3", "qwen3")
_GEMMA_ARCHITECTURES = ("gemma", "gemma3")
# Types a weight may be stored in: floats and llama.cpp's block quantizations (integer types hold no weights).
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")
# llama.cpp's Gemma 3 runs sliding-window layers with RoPE base 10000 (the file states only the global base).
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_SLIDING_PATTERN = 6  # every 6th layer is global, unless the file lists the pattern
# llama.cpp scales Gemma 3 queries by head_dim ** -0.5, except for the 27B (62 layers): (hidden / heads) ** -0.5.
_GEMMA3_27B_LAYERS = 62


def load_gguf(path: str, dtype=jnp.float32) -> CausalLM:
    """Load the GGUF file `path` (architecture llama, gemma, gemma3 or qwen3) as a model with parameters in `dtype`.

    Every tensor is dequantized to float32 first (F32, F16, BF16 and the block types the `gguf` package
    implements: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K and more), then cast to `dtype`. Returns the model
    (`model(token_ids [B, T]) -> logits [B, T, vocab]`); `model.tokenizer` is a `tokenizers.Tokenizer` built from
    the file's vocabulary (adding BOS when `tokenizer.ggml.add_bos_token` says so) or None when the file has no
    vocabulary, and `model.eos_token_ids` the file's end-of-sequence id (a tuple, maybe empty).

    Raises FileNotFoundError for a missing file, TypeError for a `dtype` that is not a float parameter dtype (fp8
    included: `quantize_model` makes fp8 weights), and ValueError
    naming the file and the field for an unsupported architecture, tokenizer or tensor type, a metadata value of
    the wrong type or out of range (a count that is not a positive integer, a head count that does not fit the
    width, a NaN, infinite or non-positive RoPE base or norm epsilon), a declared count (layers, width, vocabulary,
    MLP width) that the tensors present do not match, a missing, empty or misshapen tensor, and a truncated or
    corrupt file. Declared counts are checked against the tensors before any model is built.
    """
    check_param_dtype("load_gguf", dtype)
    with tqdm(total=2, desc=f"Reading {os.path.basename(path)}", unit="step", leave=False) as bar:
        reader = _open(path)
        metadata = _Metadata(reader, path)
        tensors = {t.name: t for t in reader.tensors}
        hf_config = _hf_config(metadata, tensors)
        bar.total += len(tensors)
        bar.update(1)
        bar.set_description(f"Building the tokenizer of {os.path.basename(path)}")
        tokenizer = gguf_tokenizer(metadata) if "tokenizer.ggml.tokens" in metadata else None
        bar.set_description(f"Dequantizing {os.path.basename(path)}")
        graphdef, loaded = _load_tensors(path, metadata.architecture, hf_config, tensors, dtype, tokenizer, bar)
        bar.update(1)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _load_tensors(path: str, architecture: str, hf_config: dict, tensors: dict, dtype, tokenizer, bar):
    """(graphdef, [(param path, loaded variable)]) of the model hf_config describes, from the file's tensors."""
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture)
    name_map = gguf.get_tensor_name_map(arch_id, hf_config["num_hidden_layers"])
    abstract = nnx.eval_shape(lambda: model_from_config(hf_config, dtype=dtype, rngs=nnx.Rngs(0), tokenizer=tokenizer))
    graphdef, abstract_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abstract_state)

    used, missing, loaded = set(), [], []
    for param_path, variable in flat:
        name, transposed = _gguf_name(param_path, name_map)
        if name not in tensors:
            missing.append(name)
            continue
        array = _dequantize(tensors[name], path)
        if architecture in _GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        if architecture == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = hf_config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            if array.shape[0] != variable.shape[-1]:  # rows = heads * head_dim: the permutation needs that first
                raise ValueError(
                    f"{path!r}: tensor {name!r} has {array.shape[0]} rows, expected {variable.shape[-1]} "
                    f"({heads} heads of {hf_config['head_dim']} from the attention.head_count* and key_length fields)"
                )
            array = _unpermute_rows(array, heads)
        if transposed:
            array = array.T
        if array.shape != variable.shape:
            raise ValueError(
                f"{path!r}: tensor {name!r} has shape {array.shape} (after transpose: {transposed}), expected "
                f"{variable.shape} from the metadata"
            )
        used.add(name)
        loaded.append((param_path, variable.replace(jnp.asarray(array, dtype=dtype))))
        bar.update(1)
    if missing:
        raise ValueError(f"{path!r}: the file lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}")
    # rope_freqs carries the llama3 RoPE scaling, already read into the config.
    unexpected = sorted(set(tensors) - used - {"rope_freqs.weight"})
    if unexpected:
        raise ValueError(f"{path!r}: the file has tensors the model does not use, e.g. {unexpected[:5]}")

    return graphdef, loaded


class _Reader(gguf.GGUFReader):
    """GGUFReader on a plain ndarray view of its memmap: the reader slices the file once per vocabulary entry
    (three arrays of 262144 for Gemma 3), and np.memmap slices cost ~3x more than plain ndarray slices."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value):
        self._plain = value.view(np.ndarray)


def _open(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: {path!r} is not a file (expected a GGUF file)")
    try:
        return _Reader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct/numpy errors alike on a bad file
        raise ValueError(f"{path!r}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e


class _Metadata:
    """The key-value fields of an open GGUF file, with errors that name the file and the field."""

    def __init__(self, reader, path: str):
        self.fields = reader.fields
        self.path = path
        if "general.architecture" not in self.fields:
            raise ValueError(f"{path!r}: field 'general.architecture' is missing")
        self.architecture = str(self.fields["general.architecture"].contents())

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        if key not in self.fields:
            raise ValueError(f"{self.path!r}: field {key!r} is missing (architecture {self.architecture!r})")
        return self.fields[key].contents()

    def arch(self, key: str, default=None, required: bool = False):
        """The field `{architecture}.{key}`."""
        full = f"{self.architecture}.{key}"
        return self.require(full) if required else self.get(full, default)

    def arch_count(self, key: str, default=None, required: bool = False) -> int | None:
        """The field `{architecture}.{key}` as an integer >= 1 (None when absent and no default)."""
        value = self.arch(key, default, required)
        if value is None:
            return None
        is_number = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
        if not is_number or not math.isfinite(value) or value != int(value) or value < 1:
            raise ValueError(f"{self.path!r}: field '{self.architecture}.{key}' is {value!r}, expected an integer >= 1")
        return int(value)

    def arch_positive(self, key: str, default=None, required: bool = False) -> float:
        """The field `{architecture}.{key}` as a finite number > 0."""
        value = self.arch(key, default, required)
        if not isinstance(value, (int, float, np.number)) or isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{self.path!r}: field '{self.architecture}.{key}' is {value!r}, expected a number > 0")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{self.path!r}: field '{self.architecture}.{key}' is {value!r}, expected a finite number > 0"
            )
        return float(value)


def _hf_config(metadata: _Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """The HF config dict (model_type llama, gemma, gemma3_text or qwen3) that the GGUF metadata (and, for the llama3
    RoPE scaling and the presence of biases and an LM head, the tensors by name) describes."""
    arch = metadata.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{metadata.path!r}: field 'general.architecture' is {arch!r}, expected one of {SUPPORTED_ARCHITECTURES}"
        )
    num_heads = metadata.arch_count("attention.head_count", required=True)
    hidden = metadata.arch_count("embedding_length", required=True)
    vocab = metadata.arch_count("vocab_size")
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists dimensions innermost first: [hidden, vocab]
    if vocab is None:
        vocab = len(metadata.require("tokenizer.ggml.tokens"))
    layers = metadata.arch_count("block_count", required=True)
    intermediate = metadata.arch_count("feed_forward_length", required=True)
    _check_declared_counts(metadata, tensors, layers=layers, hidden=hidden, vocab=vocab, intermediate=intermediate)
    num_kv_heads = metadata.arch_count("attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{metadata.path!r}: field '{arch}.attention.head_count_kv' is {num_kv_heads}, expected a divisor of "
            f"'{arch}.attention.head_count' ({num_heads})"
        )
    head_dim = metadata.arch_count("attention.key_length") or metadata.arch_count("rope.dimension_count")
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(
                f"{metadata.path!r}: field '{arch}.attention.head_count' is {num_heads}, which does not divide "
                f"'{arch}.embedding_length' ({hidden}); expected a divisor, or the head size in "
                f"'{arch}.attention.key_length'"
            )
        head_dim = hidden // num_heads
    if head_dim % 2:  # RoPE rotates pairs
        raise ValueError(
            f"{metadata.path!r}: the head size is {head_dim} ({arch}.attention.key_length or "
            f"{arch}.rope.dimension_count or embedding_length / head_count), expected an even number"
        )
    config = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=metadata.arch_positive("attention.layer_norm_rms_epsilon", 1e-6),
        attention_bias="blk.0.attn_q.bias" in tensors,
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        tie_word_embeddings="output.weight" not in tensors,
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        # The context the model was trained for (llama.cpp's n_ctx_train): generate refuses to run past it.
        max_position_embeddings=metadata.arch_count("context_length"),
    )
    rope = {"rope_theta": metadata.arch_positive("rope.freq_base", 10000.0)}
    scaling = metadata.arch("rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=metadata.arch_positive("rope.scaling.factor", required=True))
    elif scaling not in (None, "none"):
        raise ValueError(f"{metadata.path!r}: field '{arch}.rope.scaling.type' is {scaling!r}, expected 'linear'")

    if arch == "llama":
        if "rope_freqs.weight" in tensors:
            rope = _llama3_rope(metadata.path, tensors["rope_freqs.weight"], rope, config["head_dim"])
        return dict(config, model_type="llama", rope_parameters=rope, mlp_bias="blk.0.ffn_gate.bias" in tensors)
    if arch == "gemma":
        return dict(config, model_type="gemma", rope_parameters=rope, hidden_activation="gelu_pytorch_tanh")
    if arch == "qwen3":  # llama.cpp keeps Qwen3's rotate-half Q/K rows and plain norms: nothing to undo
        if "rope_freqs.weight" in tensors:
            raise ValueError(f"{metadata.path!r}: tensor 'rope_freqs.weight' is not supported for architecture 'qwen3'")
        return dict(config, model_type="qwen3", rope_parameters=rope)
    pattern = metadata.arch("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one bool per layer: whether it uses the sliding window
        if len(pattern) != layers:
            raise ValueError(
                f"{metadata.path!r}: field '{arch}.attention.sliding_window_pattern' has {len(pattern)} entries, "
                f"expected one per layer ({layers}, '{arch}.block_count')"
            )
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        layer_types = [
            "sliding_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN else "full_attention" for i in range(layers)
        ]
    scalar = hidden // num_heads if layers == _GEMMA3_27B_LAYERS else config["head_dim"]
    return dict(
        config,
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        layer_types=layer_types,
        sliding_window=metadata.arch_count("attention.sliding_window", required=True),
        query_pre_attn_scalar=scalar,
        rope_parameters={
            "full_attention": rope,
            "sliding_attention": {"rope_theta": metadata.arch_positive("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA)},
        },
    )


def _check_declared_counts(metadata: _Metadata, tensors: dict, *, layers, hidden, vocab, intermediate) -> None:
    """Raises ValueError naming the field when a declared count disagrees with the tensors the file holds (a model
    is built from the counts, so a wrong one would otherwise cost memory before any tensor is compared)."""
    arch = metadata.architecture
    present = sorted({int(m.group(1)) for name in tensors if (m := re.match(r"blk\.(\d+)\.", name))})
    if len(present) != layers or (present and present[-1] != layers - 1):  # sorted, distinct: 0..layers-1
        found = f"layers {present[0]}..{present[-1]} ({len(present)} in all)" if present else "no layer tensors"
        raise ValueError(
            f"{metadata.path!r}: field '{arch}.block_count' is {layers}, but the file has tensors (blk.N.*) for "
            f"{found}; expected blk.0 ... blk.{layers - 1}"
        )
    # GGUF lists dimensions innermost first: [in, out].
    for name, expected, fields in (
        ("token_embd.weight", (hidden, vocab), ("embedding_length", "vocab_size")),
        ("blk.0.ffn_up.weight", (hidden, intermediate), ("embedding_length", "feed_forward_length")),
    ):
        if name in tensors and tuple(int(d) for d in tensors[name].shape) != expected:
            declared = ", ".join(f"'{arch}.{f}' = {e}" for f, e in zip(fields, expected))
            raise ValueError(
                f"{metadata.path!r}: tensor {name!r} has shape {[int(d) for d in tensors[name].shape]} (GGUF order), "
                f"expected {list(expected)} from {declared}"
            )


def _llama3_rope(path: str, rope_freqs, rope: dict, head_dim: int) -> dict:
    """The llama3 RoPE scaling llama.cpp stored as per-frequency divisors in `rope_freqs.weight`.

    The file keeps only the divisors; we take the factor from them and Llama 3's published band edges
    (low_freq_factor 1, high_freq_factor 4, original context 8192), and check that these reproduce them.
    """
    divisors = np.asarray(_dequantize(rope_freqs, path), np.float64).reshape(-1)
    params = dict(
        rope,
        rope_type="llama3",
        factor=float(divisors.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    plain = RopeConfig(theta=rope["rope_theta"]).inverse_frequencies(head_dim).astype(np.float64)
    scaled = RopeConfig.from_hf(params, rope["rope_theta"]).inverse_frequencies(head_dim).astype(np.float64)
    if divisors.shape != plain.shape or not np.allclose(plain / scaled, divisors, rtol=1e-3):
        raise ValueError(
            f"{path!r}: tensor 'rope_freqs.weight' is not the llama3 scaling with factor "
            f"{params['factor']} and Llama 3's band edges; other RoPE frequency tables are not supported"
        )
    return params


def _gguf_name(param_path: tuple, name_map) -> tuple[str, bool]:
    """(GGUF tensor name, whether it is a transposed linear kernel) of our parameter at `param_path`."""
    *modules, leaf = (str(p) for p in param_path)
    module = ".".join(modules)
    hf_module = module if module == "lm_head" else "model." + module
    gguf_module = name_map.get_name(hf_module)
    if gguf_module is None:
        raise ValueError(f"parameter {'.'.join((*modules, leaf))}: no GGUF tensor name for {hf_module!r}")
    suffix = ".bias" if leaf == "bias" else ".weight"
    return gguf_module + suffix, leaf == "kernel"


def _dequantize(tensor, path: str) -> np.ndarray:
    """The float32 values of a GGUF tensor, in numpy order (GGUF lists dimensions innermost first)."""
    qtype = tensor.tensor_type
    if qtype.name in _INTEGER_TYPES:
        raise ValueError(f"{path!r}: tensor {tensor.name!r} has type {qtype.name}, expected a float or quantized type")
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    count = int(np.prod(tensor.shape))
    if count == 0:
        raise ValueError(
            f"{path!r}: tensor {tensor.name!r} ({qtype.name}) has shape {[int(d) for d in tensor.shape]} with no "
            "elements, expected every dimension >= 1"
        )
    if tensor.data.nbytes != count // block * block_bytes:
        raise ValueError(
            f"{path!r}: tensor {tensor.name!r} ({qtype.name}, shape {tuple(int(d) for d in tensor.shape)}) has "
            f"{tensor.data.nbytes} bytes, expected {count // block * block_bytes} (truncated file?)"
        )
    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"{path!r}: tensor {tensor.name!r} has type {qtype.name}, which the gguf package cannot dequantize"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(values, np.float32).reshape(shape)


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row permutation (interleaved pairs back to HF's rotate-half halves)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

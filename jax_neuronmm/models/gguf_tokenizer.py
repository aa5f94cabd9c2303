"""A `tokenizers.Tokenizer` from the vocabulary a GGUF file stores (llama.cpp's `tokenizer.ggml.*` fields).

Two vocabulary kinds (`tokenizer.ggml.model`):
- "llama": SentencePiece BPE with byte fallback (Llama 1/2, Gemma). The file stores tokens and scores but no
  merges; merges are derived from the vocabulary, every split of a token into two tokens, ranked best-first by the
  merged token's score (for Gemma files by the token's position in the file, which is its merge order: the stored
  scores do not follow it). Gemma marks spaces by "▁" in its normalizer; Llama by a Metaspace pre-tokenizer that
  adds a prefix space when `tokenizer.ggml.add_space_prefix` (default true) says so.
- "gpt2": byte-level BPE (Llama 3, Qwen3) with the merges the file stores and the split regex `tokenizer.ggml.pre`
  names.

Tokens the file marks as control (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so that both are matched whole in text. BOS (and EOS) are added as `tokenizer.ggml.add_bos_token`
(`add_eos_token`) say; a SentencePiece file that does not say adds BOS, as llama.cpp does.
"""

from __future__ import annotations

import operator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

KINDS = ("llama", "gpt2")
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_SPACE = "\u2581"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values whose split regex is Llama 3's.
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
# Qwen2 / Qwen3 ("qwen2"): Llama 3's regex with digits split one at a time.
_SPLITS = {**dict.fromkeys(_LLAMA3_PRE, _LLAMA3_SPLIT), "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")}


def gguf_tokenizer(metadata) -> Tokenizer:
    """The tokenizer of a GGUF file; `metadata` is gguf_loading's field reader (`get`, `require`, `path`)."""
    kind = metadata.require("tokenizer.ggml.model")
    tokens = [str(t) for t in metadata.require("tokenizer.ggml.tokens")]
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [])
    if kind == "llama":
        tokenizer = _sentencepiece(metadata, tokens)
        spelled = None
    elif kind == "gpt2":
        tokenizer, spelled = _byte_level(metadata, tokens)
    else:
        raise ValueError(f"{metadata.path!r}: field 'tokenizer.ggml.model' is {kind!r}, expected one of {KINDS}")

    vocab = tokenizer.get_vocab()
    # A control token spelled outside the byte alphabet of a byte-level vocabulary is a llama.cpp mislabel.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind_ in zip(tokens, token_types)
        if kind_ == _CONTROL and (spelled is None or set(t) <= spelled)
    ]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, token_types)
            if kind_ == _USER_DEFINED and t in vocab
        ]
    )
    _add_bos_eos(tokenizer, metadata, tokens, default_bos=kind == "llama")
    return tokenizer


def _sentencepiece(metadata, tokens: list[str]) -> Tokenizer:
    gemma = metadata.architecture.startswith("gemma")
    if gemma:
        # Gemma files store tokens of two or more spaces as spaces; the normalizer turns spaces into "▁".
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = [float(s) for s in metadata.require("tokenizer.ggml.scores")]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else "<unk>"
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(vocab, dict(zip(tokens, scores))),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    else:
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best merged-token score first (ties: longer left piece,
    then longer right piece, then vocabulary order), as SentencePiece BPE applies them."""
    merges = []
    for token, score in scores.items():
        if len(token) < 2:
            continue
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        if len(pairs) > 1:
            pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(score, len(left), len(right), left, right) for left, right in pairs]
    merges.sort(key=operator.itemgetter(0, 1, 2), reverse=True)  # stable: ties keep vocabulary order
    return [(left, right) for _, _, _, left, right in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (byte-level BPE vocabularies are written in it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level(metadata, tokens: list[str]) -> tuple[Tokenizer, set[str]]:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in metadata.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, alphabet


def _add_bos_eos(tokenizer: Tokenizer, metadata, tokens: list[str], *, default_bos: bool) -> None:
    ends = []
    for which, default in (("bos", default_bos), ("eos", False)):
        token_id = metadata.get(f"tokenizer.ggml.{which}_token_id")
        wanted = bool(metadata.get(f"tokenizer.ggml.add_{which}_token", default))
        ends.append((tokens[int(token_id)], int(token_id)) if wanted and token_id is not None else None)
    bos, eos = ends
    if bos is None and eos is None:
        return

    def template(segment: str, type_id: int) -> str:
        parts = ([f"{bos[0]}:{type_id}"] if bos else []) + [f"${segment}:{type_id}"]
        return " ".join(parts + ([f"{eos[0]}:{type_id}"] if eos else []))

    tokenizer.post_processor = processors.TemplateProcessing(
        single=template("A", 0),
        pair=template("A", 0) + " " + template("B", 1),
        special_tokens=sorted({e for e in ends if e is not None}, key=lambda e: e[1]),
    )

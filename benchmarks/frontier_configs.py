"""The frontier report's configurations: what each row compresses and quantizes, the speed-only rows, the targets,
and the DecodeSpec a configuration's weights give (the modeled speed's input)."""

from __future__ import annotations

import dataclasses

from jax_neuronmm.models import decode
from jax_neuronmm.pipeline.distill import DistillOptions
from jax_neuronmm.pipeline.recipe import RECOMMENDED_STEPS
from nki_kernels import ranks
from nki_kernels.decode.contract import PROJECTIONS, WEIGHTS
from nki_kernels.decode.packing import attention_packing

GEMMA = "Gemma 3 270M"
SPEED_ONLY_MODELS = ("Llama-3.2-1B", "Llama-3.1-8B")
BATCHES = (1, 8)
CACHE_LEN = 512
TEXTS = ("novel", "technical")
FP8 = "float8_e4m3"
# The recommended-pipeline rows train on 160 windows (Config.distill_windows): the accuracy report's count when
# they were measured (it now trains on 480).
RECOMMENDED_DISTILL_WINDOWS = 160


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: the projections of `include` ("mlp", "attention", "head") SVD-factored at `keep`
    (compress_model: whitened, then `steps`; block-aligned ranks at `block`, None: compress_model's default),
    weights in bf16 or (fp8) every weight in fp8 e4m3 with float32 scales: dense ones GPTQ-rounded on the
    calibration windows (gptq) or rounded to nearest, factors rounded to nearest or (factors_gptq, the head's only)
    GPTQ-rounded too. distill_windows: training windows of the "distill" step (None: --distill_windows).
    expensive: measured only when named in --configs."""

    name: str
    include: tuple = ()
    keep: float = 1.0
    fp8: bool = False
    gptq: bool = True
    steps: tuple = ()
    block: int | None = 128
    expensive: bool = False
    factors_gptq: bool = False
    distill: DistillOptions | None = None
    distill_windows: int | None = None

    @property
    def allocated(self) -> bool:
        """Whether compression chooses the ranks (the "allocate" step): the spec is known once the model is built."""
        return "allocate" in self.steps

    @property
    def weights(self) -> str:
        return "fp8" if self.fp8 else "bf16"

    @property
    def svd(self) -> str:
        return f"{'+'.join(self.include)} {self.keep}" if self.include else "–"


HEAD_KEEPS = (0.9, 0.8, 0.7, 0.6)
# At block 128 the head's keeps 0.9 / 0.8 and 0.7 / 0.6 round to the same ranks (512, 384); at 64 they are
# 576, 512, 448, 384.
HEAD_BLOCK = 64
CONFIGS = (
    Config("dense bf16"),
    Config("dense fp8 nearest", fp8=True, gptq=False),
    Config("dense fp8 GPTQ", fp8=True),
    *(Config(f"head {keep} bf16", ("head",), keep, block=HEAD_BLOCK) for keep in HEAD_KEEPS),
    *(Config(f"head {keep} fp8", ("head",), keep, fp8=True, block=HEAD_BLOCK) for keep in HEAD_KEEPS),
    *(
        Config(f"head {keep} fp8 GPTQ factors", ("head",), keep, fp8=True, factors_gptq=True, block=HEAD_BLOCK)
        for keep in (0.9, 0.8)
    ),
    # The head's factors distilled (full-vocabulary KL at 64 sampled positions, 120 steps: the head-only step runs
    # the 262k-column head forward and backward at every position it samples) before rounding to fp8. Keep 0.69 at
    # block 8 is rank 440: a point between block 64's ranks 448 and 384.
    *(
        Config(
            f"head {keep} fp8 distilled",
            ("head",),
            keep,
            fp8=True,
            steps=("distill",),
            block=block,
            distill=DistillOptions(steps=120, positions=64, vocab_top_k=0),
        )
        for keep, block in ((0.7, HEAD_BLOCK), (0.69, 8))
    ),
    # The same with every forward pass of the distillation seeing the factors rounded to fp8 (straight through).
    Config(
        "head 0.69 fp8 distilled through fp8",
        ("head",),
        0.69,
        fp8=True,
        steps=("distill",),
        block=8,
        distill=DistillOptions(steps=120, positions=64, vocab_top_k=0, weight_dtype=FP8),
    ),
    # The layers' rows keep the pipeline they were measured with (uniform ranks, which the speed spec assumes).
    *(
        Config(
            f"{name} 0.8 sequential + distilled {'fp8' if fp8 else 'bf16'}",
            include,
            0.8,
            fp8,
            True,
            ("sequential", "distill"),
            distill=DistillOptions(steps=200, positions=128, vocab_top_k=0, eval_every=25),
        )
        for name, include in (("mlp", ("mlp",)),)
        for fp8 in (False, True)
    ),
    # Every keep over the MLPs, MLPs + attention and + head: compress_model's recommended pipeline as a user runs it
    # (output Fisher weighting, ranks allocated across projections, 480 distillation steps on 160 training windows),
    # then for fp8 every weight quantized as above. Allocated ranks differ across layers: their modeled speed is of
    # the built model's spec, traced once the row is measured.
    *(
        Config(
            f"{'+'.join(include)} {keep} recommended {'fp8' if fp8 else 'bf16'}",
            include,
            keep,
            fp8,
            True,
            RECOMMENDED_STEPS,
            block=None,
            distill=DistillOptions(),
            distill_windows=RECOMMENDED_DISTILL_WINDOWS,
        )
        for include in (("mlp",), ("mlp", "attention"), ("mlp", "attention", "head"))
        for keep in (0.9, 0.8, 0.6)
        for fp8 in (False, True)
    ),
)
CONFIGS = tuple(dataclasses.replace(c, expensive="distill" in c.steps) for c in CONFIGS)
# Speed only (no checkpoint): the decode_compositions cases' ranks (block 128).
SPEED_ONLY_CONFIGS = (
    Config("dense bf16"),
    Config("dense fp8", fp8=True),
    Config("head 0.8 fp8", ("head",), 0.8, fp8=True),
    Config("every projection + head 0.8 fp8", ("mlp", "attention", "head"), 0.8, fp8=True),
)
# The targets: (name, at least this modeled speedup over bf16 dense looped on every target at batch 1,
# at most this worst-text perplexity ratio, only configurations with SVD factors in fp8).
TARGET_SPEEDUPS = (("a", 1.9, 1.03, False), ("b", 2.3, 1.08, True))
DENSE_FP8_TARGET = 1.02


def config_spec(base, config: Config, row: dict | None = None):
    """`base` (a dense DecodeSpec) as `config` stores its weights: block-aligned ranks of the included projections
    (the same in every layer) and head, or for an allocated config the ranks its built model held (`row["ranks"]`,
    `spec_ranks`; None before the row is measured); every weight in fp8 with config.fp8, the fp8 attention factors
    packed where `attention_packing` packs them (as models.decode.model_spec of the built model)."""

    def group(projection):
        return "attention" if projection in decode.ATTENTION else "mlp"

    if config.allocated:
        if row is None or "ranks" not in row:
            return None
        layer_ranks = tuple(None if r is None else tuple(r) for r in row["ranks"]["layers"])
        head_rank = row["ranks"]["head"]
    else:
        layer_ranks = tuple(
            (ranks.block_aligned_rank(base.in_features(p), base.out_features(p), config.keep, config.block),)
            * base.num_layers
            if group(p) in config.include
            else None
            for p in PROJECTIONS
        )
        head_rank = None
        if "head" in config.include:
            head_rank = ranks.block_aligned_rank(base.hidden, base.vocab, config.keep, config.block)
    spec = base.replace(ranks=layer_ranks, head_rank=head_rank, fp8_weights=WEIGHTS if config.fp8 else ())
    return spec.replace(packed_weights=attention_packing(spec, fp8_only=True))


def spec_ranks(spec) -> dict:
    """The ranks of a built model's DecodeSpec as a row stores them (JSON): per projection of PROJECTIONS, its
    per-layer ranks or None (dense), and the head's rank or None."""
    return {"layers": [None if r is None else list(r) for r in spec.ranks], "head": spec.head_rank}

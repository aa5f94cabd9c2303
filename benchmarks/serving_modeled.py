"""The serving engine on Trainium, modeled: a recorded engine schedule priced on the decode-step cost model, and how
many sequences fit in one NeuronCore's share of HBM (benchmarks/serving.py writes both into its report).

Schedule: every step of an engine run (`Engine(on_step=...)`: kind, batch rows, tokens, block-table width). A
decode step is priced as the paged looped kernel (nki_kernels.decode.compositions' looped step, count-only trace on
the emulator, full depth) at its batch bucket and its table's slots (width x block size), each (rows, slots) traced
once. A prefill step (a chunk per row, no logits: the engine samples a prompt's first token in the row's first
decode step) is priced at its roofline (the larger of its matmul flops at TensorE's peak and its bytes at the core's
peak DMA rate: a lower bound; the project has no prefill kernel to trace). Launch
overhead: 0 µs.

Capacity: weights (every projection and the LM head, plus the bf16 embedding table where the head is not that
table) + KV blocks of bf16 per sequence at a context, in one NeuronCore's share of its chip's HBM.
"""

from __future__ import annotations

import collections

from harness import comparison  # sibling package: the script's folder is on sys.path

from nki_kernels.decode import traffic
from nki_kernels.emulator.cost_model import roofline_us

TARGETS = comparison.TARGETS
# [ARCH] trn1: "2 HBM stacks ... 32GiB" shared by 2 NeuronCores; trn2: "4 HBM stacks ... 96GiB" shared by 8 physical
# NeuronCores (AWS's Trn1 / Trn2 architecture guides in aws-neuron/aws-neuron-sdk).
HBM_BYTES_PER_CORE = {"trn1": 32 * 2**30 // 2, "trn2": 96 * 2**30 // 8}
WEIGHT_KINDS = ("bf16", "fp8", "compressed bf16", "compressed fp8")  # compressed: keep comparison.KEEP
CONTEXTS = (2048, 8192)
STANDALONE_BATCH = 8
TARGET_RATIO = 0.9  # engine's modeled tok/s at batch 8 over the looped kernel's standalone tok/s at batch 8


def record_row(record) -> list:
    """A StepRecord as the JSON keeps it: [kind, rows, tokens, table_width, active rows, real tokens]."""
    return [record.kind, record.rows, record.tokens, record.table_width, len(record.lengths), sum(record.counts)]


def weights_spec(model: comparison.DecodeModel, kind: str):
    """`model`'s spec at full depth with `kind`'s weights (WEIGHT_KINDS)."""
    return comparison.decode_spec(model, model.num_layers, kind.startswith("compressed"), kind.endswith("fp8"))


def prefill_us(spec, rows: int, tokens: int, slots: int, target: str) -> float:
    """Roofline µs of one prefill step: `rows` rows of a `tokens`-token chunk (padding included: a compiled step
    computes it) over `slots` cache slots: 2·rows·T·(projection weights) flops and the layers' must-move bytes for
    the rows. No LM head: the step samples nothing (`models.paged.paged_prefill`)."""
    dense = spec.replace(fp8_weights=(), packed_weights=())
    flops = 2 * rows * tokens * traffic.weight_bytes(dense, 1, head=False)
    nbytes = traffic.must_move_bytes(spec, rows, slots, layers_only=True, tokens=tokens)
    return roofline_us(flops, nbytes, target)


def price_schedule(schedule: list, model: comparison.DecodeModel, kind: str, block_size: int, max_slots: int):
    """{"decode": {"rows,slots": {target: µs}}, "standalone": {target: µs}, "standalone_at_slots": {slots: {target:
    µs}}, "prefill": {"rows,tokens,slots": {target: µs}}}: each decode shape of `schedule` (record_row lists) traced
    once as the paged looped kernel, the looped kernel alone at STANDALONE_BATCH rows over a contiguous cache of
    max_slots slots and of each decode step's slots, and each prefill step's shape at its roofline."""
    spec = weights_spec(model, kind)
    paged = spec.replace(block_size=block_size)
    decode = {}
    for step_kind, rows, _, width, _, _ in schedule:
        key = f"{rows},{width * block_size}"
        if step_kind == "decode" and key not in decode:
            measured = comparison.measure_spec(paged, "looped", rows, width * block_size)
            decode[key] = dict(measured.kernel_us, note=measured.note)
            print(kind, key, decode[key], flush=True)
    alone = comparison.measure_spec(spec, "looped", STANDALONE_BATCH, max_slots)
    # Like for like: the looped kernel alone at STANDALONE_BATCH rows over a contiguous cache of each decode step's
    # own slots, so the engine's narrower tables are not counted as a scheduling gain.
    alone_at = {}
    for step_kind, _, _, width, _, _ in schedule:
        slots = width * block_size
        if step_kind == "decode" and str(slots) not in alone_at:
            measured = comparison.measure_spec(spec, "looped", STANDALONE_BATCH, slots)
            alone_at[str(slots)] = dict(measured.kernel_us, note=measured.note)
    prefill = {
        f"{rows},{tokens},{width * block_size}": {
            t: prefill_us(spec, rows, tokens, width * block_size, t) for t in TARGETS
        }
        for k, rows, tokens, width, _, _ in schedule
        if k != "decode"
    }
    return dict(
        block_size=block_size,
        max_slots=max_slots,
        decode=decode,
        standalone=dict(alone.kernel_us, note=alone.note),
        standalone_at_slots=alone_at,
        prefill=prefill,
    )


def schedule_tokens(schedule: list) -> int:
    """Output tokens of `schedule` (record_row lists): every active row of a decode step samples one token (a new
    row its first, from its prompt's last token); prefill steps sample none."""
    return sum(row[4] for row in schedule if row[0] == "decode")


def saturated(schedule: list) -> list:
    """The steps up to the last prefill step: while requests still waited for rows (closed-loop clients keep the
    queue full until the run's last request is admitted); after it the last rows drain one by one, which a server
    under steady load never does."""
    prefills = [i for i, row in enumerate(schedule) if row[0] != "decode"]
    return schedule[: prefills[-1] + 1] if prefills else schedule


def modeled_rate(schedule: list, priced: dict, target: str) -> dict | None:
    """The engine's modeled tok/s on `target` over `schedule` (a whole run's or a part of it, e.g. `saturated`):
    schedule_tokens ÷ (decode steps' µs + prefill steps' µs); its decode-only tok/s, the standalone looped kernel's
    tok/s over the same cache lengths step by step (the ratios' denominator) and over the whole context; None when
    a shape did not run there."""
    decode_steps = [(rows, width) for kind, rows, _, width, _, _ in schedule if kind == "decode"]
    block_size = priced["block_size"]
    costs = [priced["decode"][f"{rows},{width * block_size}"].get(target) for rows, width in decode_steps]
    alone = priced["standalone"].get(target)
    if alone is None or any(c is None for c in costs):
        return None
    alone_at = [priced["standalone_at_slots"][str(width * block_size)].get(target) for _, width in decode_steps]
    if any(a is None for a in alone_at):
        return None
    decode_us = sum(costs)
    prefill_us = sum(
        priced["prefill"][f"{rows},{tokens},{width * block_size}"][target]
        for kind, rows, tokens, width, _, _ in schedule
        if kind != "decode"
    )
    total_us = decode_us + prefill_us
    standalone = STANDALONE_BATCH / alone * 1e6
    # The standalone kernel doing as many steps over the same cache lengths, STANDALONE_BATCH tokens each.
    like_for_like = STANDALONE_BATCH * len(alone_at) / sum(alone_at) * 1e6
    tokens = schedule_tokens(schedule)
    engine, decode_only = tokens / total_us * 1e6, tokens / decode_us * 1e6
    return dict(
        engine=engine,
        decode_only=decode_only,
        standalone=standalone,
        standalone_same_slots=like_for_like,
        ratio=engine / like_for_like,
        decode_ratio=decode_only / like_for_like,
        ratio_full_context=engine / standalone,
        decode_us=decode_us,
        prefill_us=prefill_us,
    )


def paged_over_contiguous(modeled: dict) -> tuple[int, dict]:
    """(slots, {kind: {target: ratio}}): the paged step ÷ the contiguous one at STANDALONE_BATCH rows and the slots of
    the schedule's most common full-batch decode step: what decode-only ÷ alone owes to the kernels, not the
    scheduler."""
    widths = collections.Counter(
        row[3] for row in modeled["schedule"] if row[0] == "decode" and row[1] == STANDALONE_BATCH
    )
    ratios = {}
    for kind, priced in modeled["priced"].items():
        slots = widths.most_common(1)[0][0] * priced["block_size"]
        paged, alone = priced["decode"][f"{STANDALONE_BATCH},{slots}"], priced["standalone_at_slots"][str(slots)]
        ratios[kind] = {t: paged[t] / alone[t] for t in TARGETS if t in paged and t in alone}
    return slots, ratios


def sweep_lines(modeled: dict) -> list[str]:
    """The Markdown table of engine ÷ alone (whole run) per EngineOptions.prefill_ahead: the report's schedule and
    those of modeled["sweep"] (the same mix run again at other values), priced alike."""
    schedules = {str(modeled["prefill_ahead"]): modeled["schedule"], **modeled.get("sweep", {})}
    columns = [(kind, t) for kind in modeled["priced"] for t in TARGETS]
    lines = [
        "| prefill_ahead | prefill steps | decode steps | " + " | ".join(f"{k} {t}" for k, t in columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for ahead in sorted(schedules, key=int):
        steps = schedules[ahead]
        cells = []
        for kind, t in columns:
            rate = modeled_rate(steps, modeled["priced"][kind], t)
            cells.append("-" if rate is None else f"{rate['ratio']:.3f}")
        prefills = sum(row[0] != "decode" for row in steps)
        default = " (default)" if int(ahead) == modeled["prefill_ahead"] else ""
        lines.append(f"| {ahead}{default} | {prefills} | {len(steps) - prefills} | " + " | ".join(cells) + " |")
    return lines


def capacity_rows(models: list) -> list[dict]:
    """Per model and WEIGHT_KINDS: weight bytes, KV bytes per sequence at each of CONTEXTS, and the sequences that
    fit per NeuronCore on each target (0 when the weights alone do not fit)."""
    rows = []
    for model in models:
        spec = model.spec
        embedding = spec.vocab * spec.hidden * 2
        for kind in WEIGHT_KINDS:
            s = weights_spec(model, kind)
            norms = s.num_layers * (s.num_norms * s.hidden + (2 * s.head_dim if s.qk_norm else 0)) * 2
            weights = traffic.weight_bytes(s, 2, head=True) + norms + (0 if kind == "bf16" else embedding)
            row = dict(model=model.name, weights=kind, weight_bytes=weights, kv_bytes={}, sequences={})
            for context in CONTEXTS:
                per_seq = 2 * s.num_layers * s.num_kv_heads * s.head_dim * context * 2
                row["kv_bytes"][str(context)] = per_seq
                for t, hbm in HBM_BYTES_PER_CORE.items():
                    row["sequences"][f"{t},{context}"] = max(0, (hbm - weights) // per_seq)
            rows.append(row)
    return rows


def capacity_lines(rows: list[dict]) -> list[str]:
    """The Markdown table of capacity_rows."""
    head = "".join(f"| seqs at {c} tokens {t} " for c in CONTEXTS for t in HBM_BYTES_PER_CORE)
    lines = [
        "| model | weights | weights MiB | KV MiB per sequence (" + " / ".join(map(str, CONTEXTS)) + ") " + head + "|",
        "|---|---|---|---|" + "---|" * (len(CONTEXTS) * len(HBM_BYTES_PER_CORE)),
    ]
    for r in rows:
        kv = " / ".join(f"{r['kv_bytes'][str(c)] / 2**20:.1f}" for c in CONTEXTS)
        cells = "".join(f"| {r['sequences'][f'{t},{c}']:,} " for c in CONTEXTS for t in HBM_BYTES_PER_CORE)
        lines.append(f"| {r['model']} | {r['weights']} | {r['weight_bytes'] / 2**20:.1f} | {kv} {cells}|")
    return lines


def schedule_lines(modeled: dict) -> list[str]:
    """The Markdown table of the priced schedule: per weights and target, the engine's modeled tok/s, decode-only,
    the standalone looped kernel's, the ratios against TARGET_RATIO (the whole run's decides), and the ratio over
    the saturated steps alone (`saturated`: before the last rows drain)."""
    schedule = modeled["schedule"]
    busy = saturated(schedule)
    lines = [
        f"| model (traced) | weights | hw | engine tok/s (decode + prefill) | decode-only tok/s | looped alone, batch "
        f"{STANDALONE_BATCH}, same cache lengths, tok/s | engine / alone | decode-only / alone | alone over the whole "
        f"context, tok/s (engine / it) | engine / alone, saturated steps ({len(busy)} of {len(schedule)}) "
        f"| target >= {TARGET_RATIO:.0%} (whole run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, priced in modeled["priced"].items():
        for t in TARGETS:
            rate = modeled_rate(schedule, priced, t)
            if rate is None:
                lines.append(f"| {modeled['model']} | {kind} | {t} | did not run | - | - | - | - | - | - | - |")
                continue
            busy_rate = modeled_rate(busy, priced, t)
            verdict = "met" if rate["ratio"] >= TARGET_RATIO else "**missed**"
            lines.append(
                f"| {modeled['model']} | {kind} | {t} | {rate['engine']:,.0f} | {rate['decode_only']:,.0f} | "
                f"{rate['standalone_same_slots']:,.0f} | {rate['ratio']:.3f} | {rate['decode_ratio']:.3f} | "
                f"{rate['standalone']:,.0f} ({rate['ratio_full_context']:.3f}) | {busy_rate['ratio']:.3f} | {verdict} |"
            )
    return lines

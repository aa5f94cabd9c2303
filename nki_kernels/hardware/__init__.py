"""Facts about the NeuronCore that kernels, the footprint model, the tuner and the emulator read.

Sizes per partition (AWS's Trn1 / Trn2 architecture pages; NKI docs for `nl.tile_size`): the PE array is
128 × 128, a matmul's moving operand spans up to 512 columns (one 2 KiB PSUM bank of float32), SBUF holds
24 MiB / 128 = 192 KiB per partition on trn1 and 28 MiB / 128 = 224 KiB on trn2, PSUM 8 banks of 2 KiB.
Kernels themselves read the sizes through `nl.tile_size`, as kernels for the real toolchain do.
"""

TARGETS = ("trn1", "trn2")
# Names the Neuron tools accept for each target (NEURON_PLATFORM_TARGET_OVERRIDE, nc_version).
TARGET_ALIASES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2"}

PMAX = 128  # partitions; also the PE array's rows and stationary columns
STATIONARY_FMAX = 128
MOVING_FMAX = 512
SBUF_BYTES_PER_PARTITION = {"trn1": 192 * 1024, "trn2": 224 * 1024}
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8


def canonical_target(target):
    """ "trn1" or "trn2" for any name in TARGET_ALIASES (case and spaces ignored); ValueError naming `target`."""
    name = TARGET_ALIASES.get(str(target).strip().lower())
    if name is None:
        raise ValueError(f"target: unsupported NKI target {target!r}; expected one of {sorted(TARGET_ALIASES)}")
    return name


def check_target(target):
    """ValueError naming `target` unless it is exactly one of TARGETS."""
    if target not in TARGETS:
        raise ValueError(f"target: got {target!r}, expected one of {TARGETS}")

"""DecodeSpec by concern (nki_kernels.decode.spec): its parts' fields read as its own, `replace` routes each change
to its part and checks the result anew, and parts of the wrong type or a change given twice are refused."""

import dataclasses

import pytest
from decode_operands import GEMMA3, LLAMA

from nki_kernels.decode.contract import WEIGHTS, DecodeShapes, DecodeSpec, ModelVariant, WeightStorage


def test_parts_read_as_the_specs_own_fields():
    for part, kind in (("shapes", DecodeShapes), ("variant", ModelVariant), ("storage", WeightStorage)):
        value = getattr(GEMMA3, part)
        assert isinstance(value, kind)
        for field in dataclasses.fields(kind):
            assert getattr(GEMMA3, field.name) == getattr(value, field.name)
    assert GEMMA3.num_heads == 4 and GEMMA3.ranks[0] == (70, 33, 130) and GEMMA3.layer_mask == (1, 0, 1)


def test_replace_routes_each_change_to_its_part():
    spec = GEMMA3.replace(vocab=500, qk_norm=False, fp8_weights=WEIGHTS, block_size=5, tensor_parallel=1)
    assert spec.shapes == dataclasses.replace(GEMMA3.shapes, vocab=500)
    assert spec.variant == dataclasses.replace(GEMMA3.variant, qk_norm=False)
    assert spec.storage == dataclasses.replace(GEMMA3.storage, fp8_weights=WEIGHTS)
    assert spec.block_size == 5 and GEMMA3.block_size is None  # the original is unchanged
    assert hash(spec) == hash(GEMMA3.replace(vocab=500, qk_norm=False, fp8_weights=WEIGHTS, block_size=5))
    whole = LLAMA.replace(storage=WeightStorage(head_rank=7))
    assert whole.head_rank == 7 and whole.shapes is LLAMA.shapes


def test_replace_checks_the_result_and_refuses_ambiguity():
    with pytest.raises(ValueError, match=r"DecodeSpec.num_heads: got 5, expected a multiple of num_kv_heads=2"):
        LLAMA.replace(num_heads=5)
    with pytest.raises(ValueError, match="DecodeSpec.layer_rope"):
        LLAMA.replace(num_layers=3)  # the per-layer tables no longer match
    with pytest.raises(ValueError, match=r"DecodeSpec.replace: got storage= and \['fp8_weights'\]"):
        LLAMA.replace(storage=WeightStorage(), fp8_weights=WEIGHTS)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        LLAMA.replace(bogus=1)


def test_parts_of_the_wrong_type_are_refused():
    with pytest.raises(TypeError, match="DecodeSpec.shapes: got dict, expected a DecodeShapes"):
        DecodeSpec(dict(LLAMA.shapes.__dict__), LLAMA.variant)
    with pytest.raises(TypeError, match="DecodeSpec.storage: got tuple, expected a WeightStorage"):
        DecodeSpec(LLAMA.shapes, LLAMA.variant, ())

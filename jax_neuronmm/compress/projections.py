"""Names of the projections compression factors in a decoder layer (attributes of its attention and MLP)."""

ATTENTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",))  # projections sharing one input, in call order
ATTENTION_PROJECTIONS = tuple(name for group in ATTENTION_GROUPS for name in group)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def layer_projections(num_layers: int, include) -> list:
    """[(layer index, "self_attn" | "mlp", projection name)] of the projections `include` ("attention", "mlp")
    selects in each of num_layers decoder layers, in layer order."""
    selected = [("self_attn", name) for name in ATTENTION_PROJECTIONS] if "attention" in include else []
    selected += [("mlp", name) for name in MLP_PROJECTIONS] if "mlp" in include else []
    return [(index, parent, name) for index in range(num_layers) for parent, name in selected]

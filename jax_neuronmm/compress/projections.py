"""Names of the projections compression factors in a decoder layer (attributes of its attention and MLP)."""

ATTENTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",))  # projections sharing one input, in call order
ATTENTION_PROJECTIONS = tuple(name for group in ATTENTION_GROUPS for name in group)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

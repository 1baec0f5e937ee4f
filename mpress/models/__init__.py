"""Reference models (plain PyTorch): GPT, BERT and Llama built from a `ModelConfig`.

See `mpress/models/transformer.py` for the layer list ("embed", "layers.i", "head") every
family shares and how stages keep the whole model's module paths; `mpress/models/llama.py`
for the Llama family's layers.
"""

from mpress.models.transformer import (
    TransformerStage,
    build_model,
    build_stage,
    example_batch,
    layer_names,
    lm_loss,
    num_parameters,
)

__all__ = [
    "TransformerStage",
    "build_model",
    "build_stage",
    "example_batch",
    "layer_names",
    "lm_loss",
    "num_parameters",
]

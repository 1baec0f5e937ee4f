"""Reference models (plain PyTorch): GPT and BERT built from a `ModelConfig`.

See `mpress/models/transformer.py` for the layer list ("embed", "layers.i", "head") and
how stages keep the whole model's module paths.
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

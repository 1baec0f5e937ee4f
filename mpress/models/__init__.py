"""Reference models (plain PyTorch): GPT, BERT and Llama built from a `ModelConfig`.

See `mpress/models/transformer.py` for the layer list ("embed", "layers.i", "head") every
family shares and how stages keep the whole model's module paths; `mpress/models/llama.py`
for the Llama family's layers; `mpress/models/layer_counts.py` for the arithmetic of the
layer list, which needs no torch.

The names below load `transformer` (and torch) when first used, so that importing a
torch-free module of this package (`layer_counts`) does not load torch.
"""

import importlib

__all__ = [
    "TransformerStage",
    "build_model",
    "build_stage",
    "example_batch",
    "layer_names",
    "lm_loss",
    "num_parameters",
]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("mpress.models.transformer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

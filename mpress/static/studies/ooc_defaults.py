"""What `mpress ooc` offers before anything is profiled: the model names `--model` takes
and the defaults of the out-of-core study's flags. Kept apart from `ooc_model` and
`ooc_sweeps` (which import torch through the profilers), so that the command's flags,
`--help` and its argument errors come without torch.
"""

from __future__ import annotations

from mpress.config.model_config import model_presets
from mpress.config.vocabulary import ConvNetwork, SwapInPolicy

DEFAULT_IMAGE_SIZE = 224
"""Square image side of the conv nets, pixels (ImageNet's)."""

POLICIES = (SwapInPolicy.LAYER_AHEAD, SwapInPolicy.CAPACITY)
"""Both swap-in policies, in the order the tables show them."""

DEFAULT_BANDWIDTHS_GBPS = (4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 450.0)
"""Host-link GB/s per direction of the bandwidth sweep: PCIe 3 class to NVLink-C2C class."""


def conv_networks() -> list[str]:
    """The reference conv nets by name (`mpress.tiling.networks.NETWORKS` builds them)."""
    return sorted(n.value for n in ConvNetwork)


def model_choices() -> list[str]:
    """Names `--model` takes: the conv nets, then the GPT/BERT presets."""
    return conv_networks() + model_presets()

"""Reference conv pipelines for fused-tiled execution: VGG-16, VGG-19 and DarkNet-19 style
networks (random initialisation, nothing downloaded).

Each network is an `nn.Sequential` of two `nn.Sequential`s, `features` (the conv/pool
pipeline, any image size) and `head` (global average pooling, flatten, a linear
classifier), so it trains on square images of any size; the head is what a segment
cannot cross (global pooling needs the whole image). DarkNet-19 normalises with
`FrozenBatchNorm2d`: batch statistics over a whole image cannot be tiled, frozen ones can.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from mpress.config.vocabulary import ConvNetwork

VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
VGG19 = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
# (out_channels, kernel) or "M"; the YOLOv2 backbone without its final 1000-way conv
DARKNET19 = [(32, 3), "M", (64, 3), "M", (128, 3), (64, 1), (128, 3), "M", (256, 3), (128, 1), (256, 3), "M",
             (512, 3), (256, 1), (512, 3), (256, 1), (512, 3), "M", (1024, 3), (512, 1), (1024, 3), (512, 1),
             (1024, 3)]


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with frozen statistics and affine parameters as buffers: a per-channel
    affine map `x * scale + shift` in every mode, hence element-wise and tileable."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, H, W)
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale[None, :, None, None] + shift[None, :, None, None]


def _network(features: list[nn.Module], channels: int, num_classes: int) -> nn.Sequential:
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
    return nn.Sequential(OrderedDict(features=nn.Sequential(*features), head=head))


def _vgg(config: list, width_div: int, num_classes: int, in_channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    c = in_channels
    for v in config:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            out = max(1, int(v) // width_div)
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
            c = out
    return _network(layers, c, num_classes)


def vgg16(*, width_div: int = 1, num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """VGG-16's 13 3x3 convolutions and 5 max pools (channel counts divided by `width_div`)."""
    return _vgg(VGG16, width_div, num_classes, in_channels)


def vgg19(*, width_div: int = 1, num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """VGG-19's 16 3x3 convolutions and 5 max pools (channel counts divided by `width_div`)."""
    return _vgg(VGG19, width_div, num_classes, in_channels)


def darknet19(*, width_div: int = 1, num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """DarkNet-19: 3x3/1x1 convolutions with frozen batch norm and LeakyReLU(0.1), 5 max pools."""
    layers: list[nn.Module] = []
    c = in_channels
    for v in DARKNET19:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        out, k = max(1, v[0] // width_div), v[1]
        layers += [nn.Conv2d(c, out, k, padding=k // 2, bias=False), FrozenBatchNorm2d(out), nn.LeakyReLU(0.1)]
        c = out
    return _network(layers, c, num_classes)


NETWORKS: dict[str, Callable[..., nn.Sequential]] = {ConvNetwork.VGG16: vgg16, ConvNetwork.VGG19: vgg19,
                                                     ConvNetwork.DARKNET19: darknet19}
"""Reference networks by name (`mpress tile --network`, bench/sft.py)."""

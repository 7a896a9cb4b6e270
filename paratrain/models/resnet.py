"""Convolutional networks with BatchNorm: a CIFAR-style ResNet, ResNet-50 (the seed benchmark's model)
and a tiny CNN for tests."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet50", "ResNetCIFAR", "SmallCNN", "resnet_cifar"]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _he_init(model: nn.Module) -> None:
    """He et al.'s initialisation: convolutions kaiming-normal (fan out), BatchNorm scale 1 and shift 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    """Two 3×3 conv-BN layers with a residual connection (1×1 conv-BN when the shape changes)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_ch, out_ch, stride)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = _conv3x3(out_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNetCIFAR(nn.Module):
    """He et al.'s CIFAR ResNet: 3×3 stem, 3 stages (widths w, 2w, 4w; strides 1, 2, 2), pool, linear.

    Global average pooling makes it work for any input of at least 1×1 after the two stride-2
    stages, e.g. 8×8 digits and 32×32 CIFAR images.
    """

    def __init__(self, blocks_per_stage: int, in_channels: int = 3, num_classes: int = 10,
                 width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv3x3(in_channels, width), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        in_ch = width
        for stage, out_ch in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        _he_init(self)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.layers(self.stem(x)))
        return self.fc(out.flatten(1))


def resnet_cifar(depth: int = 20, in_channels: int = 3, num_classes: int = 10,
                 width: int = 16) -> ResNetCIFAR:
    """A CIFAR ResNet of ``depth = 6n + 2`` layers (8, 14, 20, 32, 44, 56, 110 ...)."""
    if depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(f"ResNet depth {depth} must be 6n+2 with n >= 1 (e.g. 8 or 20)")
    if in_channels < 1 or num_classes < 1 or width < 1:
        raise ValueError(
            f"resnet_cifar sizes must be >= 1: in_channels={in_channels}, "
            f"num_classes={num_classes}, width={width}"
        )
    return ResNetCIFAR((depth - 2) // 6, in_channels, num_classes, width)


class SmallCNN(nn.Module):
    """A tiny fast CNN for tests: (conv3×3-BN-ReLU) ×2, global average pool, linear."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1 or width < 1:
            raise ValueError(
                f"SmallCNN sizes must be >= 1: in_channels={in_channels}, "
                f"num_classes={num_classes}, width={width}"
            )
        self.features = nn.Sequential(
            _conv3x3(in_channels, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            _conv3x3(width, 2 * width), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x).flatten(1))


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (with the stride), 1×1 expand ×4, each conv-BN, with a residual connection."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50 as ``torchvision.models.resnet50(weights=None)`` builds it (7×7 stride-2 stem,
    max-pool, bottleneck stages of 3, 4, 6, 3 blocks, 25.6 M parameters at 1000 classes), without
    needing torchvision: the seed benchmark's model, applied as-is to 32×32 CIFAR-shaped images."""

    def __init__(self, in_channels: int = 3, num_classes: int = 1000) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1:
            raise ValueError(f"ResNet50 sizes must be >= 1: in_channels={in_channels}, num_classes={num_classes}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_ch = 64
        stages: list[nn.Module] = []
        for i, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(in_ch, width, stride=2 if i > 0 and b == 0 else 1))
                in_ch = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        _he_init(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))

"""The paper's models, written out compactly for the simulator: ResNet-50/152, Inception-v3,
VGG-16 and AlexNet (torchvision's layer shapes; torchvision itself does not import beside
torch 2.13 here). Built on ``device="meta"``: only shapes and structure matter, no weights
are allocated and nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _cbr(c_in: int, c_out: int, k: int | tuple[int, int], stride: int = 1,
         pad: int | tuple[int, int] = 0) -> nn.Sequential:
    """Inception's BasicConv2d: conv (no bias) + BN + ReLU."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, stride, pad, bias=False),
                         nn.BatchNorm2d(c_out, eps=0.001), nn.ReLU())


# -- ResNet (bottleneck) --------------------------------------------------------------------


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = 4 * width
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.downsample = (nn.Sequential(nn.Conv2d(c_in, out, 1, stride, bias=False),
                                         nn.BatchNorm2d(out))
                           if stride != 1 or c_in != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        skip = self.downsample(x) if self.downsample is not None else x
        return self.relu(y + skip)


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, c_in = [], 64
        for stage, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
            seq = []
            for b in range(n):
                seq.append(Bottleneck(c_in, width, 2 if b == 0 and stage > 0 else 1))
                c_in = 4 * width
            layers.append(nn.Sequential(*seq))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- Inception-v3 --------------------------------------------------------------------------


class InceptionA(nn.Module):
    def __init__(self, c: int, pool: int) -> None:
        super().__init__()
        self.branch1x1 = _cbr(c, 64, 1)
        self.branch5x5_1, self.branch5x5_2 = _cbr(c, 48, 1), _cbr(48, 64, 5, pad=2)
        self.branch3x3dbl_1 = _cbr(c, 64, 1)
        self.branch3x3dbl_2 = _cbr(64, 96, 3, pad=1)
        self.branch3x3dbl_3 = _cbr(96, 96, 3, pad=1)
        self.pool = nn.AvgPool2d(3, 1, 1)
        self.branch_pool = _cbr(c, pool, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(self.pool(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch3x3 = _cbr(c, 384, 3, stride=2)
        self.branch3x3dbl_1 = _cbr(c, 64, 1)
        self.branch3x3dbl_2 = _cbr(64, 96, 3, pad=1)
        self.branch3x3dbl_3 = _cbr(96, 96, 3, stride=2)
        self.pool = nn.MaxPool2d(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b3, bd, self.pool(x)], 1)


class InceptionC(nn.Module):
    def __init__(self, c: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = _cbr(c, 192, 1)
        self.branch7x7_1 = _cbr(c, c7, 1)
        self.branch7x7_2 = _cbr(c7, c7, (1, 7), pad=(0, 3))
        self.branch7x7_3 = _cbr(c7, 192, (7, 1), pad=(3, 0))
        self.branch7x7dbl_1 = _cbr(c, c7, 1)
        self.branch7x7dbl_2 = _cbr(c7, c7, (7, 1), pad=(3, 0))
        self.branch7x7dbl_3 = _cbr(c7, c7, (1, 7), pad=(0, 3))
        self.branch7x7dbl_4 = _cbr(c7, c7, (7, 1), pad=(3, 0))
        self.branch7x7dbl_5 = _cbr(c7, 192, (1, 7), pad=(0, 3))
        self.pool = nn.AvgPool2d(3, 1, 1)
        self.branch_pool = _cbr(c, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        for m in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                  self.branch7x7dbl_5):
            bd = m(bd)
        return torch.cat([b1, b7, bd, self.branch_pool(self.pool(x))], 1)


class InceptionD(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch3x3_1, self.branch3x3_2 = _cbr(c, 192, 1), _cbr(192, 320, 3, stride=2)
        self.branch7x7x3_1 = _cbr(c, 192, 1)
        self.branch7x7x3_2 = _cbr(192, 192, (1, 7), pad=(0, 3))
        self.branch7x7x3_3 = _cbr(192, 192, (7, 1), pad=(3, 0))
        self.branch7x7x3_4 = _cbr(192, 192, 3, stride=2)
        self.pool = nn.MaxPool2d(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_1(x)
        for m in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            b7 = m(b7)
        return torch.cat([b3, b7, self.pool(x)], 1)


class InceptionE(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch1x1 = _cbr(c, 320, 1)
        self.branch3x3_1 = _cbr(c, 384, 1)
        self.branch3x3_2a = _cbr(384, 384, (1, 3), pad=(0, 1))
        self.branch3x3_2b = _cbr(384, 384, (3, 1), pad=(1, 0))
        self.branch3x3dbl_1 = _cbr(c, 448, 1)
        self.branch3x3dbl_2 = _cbr(448, 384, 3, pad=1)
        self.branch3x3dbl_3a = _cbr(384, 384, (1, 3), pad=(0, 1))
        self.branch3x3dbl_3b = _cbr(384, 384, (3, 1), pad=(1, 0))
        self.pool = nn.AvgPool2d(3, 1, 1)
        self.branch_pool = _cbr(c, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        return torch.cat([b1, b3, bd, self.branch_pool(self.pool(x))], 1)


class InceptionV3(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _cbr(3, 32, 3, stride=2), _cbr(32, 32, 3), _cbr(32, 64, 3, pad=1),
            nn.MaxPool2d(3, 2), _cbr(64, 80, 1), _cbr(80, 192, 3), nn.MaxPool2d(3, 2))
        self.blocks = nn.Sequential(
            InceptionA(192, 32), InceptionA(256, 64), InceptionA(288, 64), InceptionB(288),
            InceptionC(768, 128), InceptionC(768, 160), InceptionC(768, 160),
            InceptionC(768, 192), InceptionD(768), InceptionE(1280), InceptionE(2048))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.blocks(self.stem(x))), 1))


# -- VGG-16 and AlexNet ----------------------------------------------------------------------


class VGG16(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                  512, 512, 512, "M"):
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU()]
                c = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(512 * 49, 4096), nn.ReLU(),
                                        nn.Linear(4096, 4096), nn.ReLU(),
                                        nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(6)
        self.classifier = nn.Sequential(nn.Linear(256 * 36, 4096), nn.ReLU(),
                                        nn.Linear(4096, 4096), nn.ReLU(),
                                        nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


META_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, int, int]]] = {
    "resnet50": (lambda: ResNet((3, 4, 6, 3)), (3, 224, 224)),
    "resnet152": (lambda: ResNet((3, 8, 36, 3)), (3, 224, 224)),
    "inception_v3": (InceptionV3, (3, 299, 299)),
    "vgg16": (VGG16, (3, 224, 224)),
    "alexnet": (AlexNet, (3, 224, 224)),
}


def build_meta(name: str) -> tuple[nn.Module, tuple[int, int, int]]:
    """(model on the meta device, per-sample input shape)."""
    if name not in META_MODELS:
        raise KeyError(f"unknown meta model {name!r}; known: {', '.join(META_MODELS)}")
    factory, shape = META_MODELS[name]
    with torch.device("meta"):
        model = factory()
    return model, shape

"""A small vision workload with buffers: generated shape images and a BatchNorm CNN.

`Shapes` draws each image from its index -- one of three shapes (a square, a cross, a ring)
at a random place, plus noise -- so it needs nothing downloaded; any map-style dataset of
(image, label) pairs (``torchvision.datasets.ImageFolder``, say) takes its place. Passed
``augment=True`` it also flips each image at random from torch's global generator, as a
data pipeline's augmentation does (see [Note: one draw for every stage] in
recovery/worker/stage.py for why that is safe).

`bn_cnn_stage` is a CNN cut into pipeline stages whose every block has a `BatchNorm2d`
(running statistics and a batch counter: buffers) and dropout: the kind of model whose
buffers and eval mode a training framework must get right (see [Note: buffers are state]
in parallelism/buffers.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = ["CLASSES", "SIZE", "Shapes", "bn_cnn_stage"]

SIZE = 24
"""Images are 1 x SIZE x SIZE."""
CLASSES = ("square", "cross", "ring")


class Shapes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``count`` 1 x 24 x 24 images of one of three shapes; image ``i`` is a pure function
    of ``(seed, i)`` (and, with ``augment``, of torch's global generator: a random flip)."""

    def __init__(self, count: int, seed: int = 0, *, augment: bool = False) -> None:
        self.count, self.seed, self.augment = count, seed, augment
        yy, xx = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
        self.grid = yy.float(), xx.float()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(f"image {i} of {self.count}")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(len(CLASSES), (), generator=g))
        cy, cx = (torch.randint(6, SIZE - 6, (2,), generator=g)).float()
        yy, xx = self.grid
        dy, dx = (yy - cy).abs(), (xx - cx).abs()
        if label == 0:
            image = ((dy <= 4) & (dx <= 4)).float()
        elif label == 1:
            image = (((dy <= 1) & (dx <= 5)) | ((dx <= 1) & (dy <= 5))).float()
        else:
            r = (dy**2 + dx**2).sqrt()
            image = ((r >= 3) & (r <= 5)).float()
        image = image + 0.8 * torch.randn(SIZE, SIZE, generator=g)
        if self.augment and bool(torch.rand(()) < 0.5):  # the global generator, as augmentations do
            image = image.flip(-1)
        return image.unsqueeze(0), torch.tensor(label)


def _block(c_in: int, c_out: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Dropout2d(dropout),
    )


def bn_cnn_stage(stage: int, num_stages: int, width: int = 8, dropout: float = 0.1) -> nn.Module:
    """Stage ``stage`` of ``num_stages`` of a CNN classifier of `Shapes`: a conv block with
    BatchNorm and dropout per stage (the first downsamples), the last stage ending in
    pooling, dropout and a linear head over `CLASSES`."""
    parts: list[nn.Module] = [_block(1 if stage == 0 else width, width, dropout)]
    if stage == 0:
        parts.append(nn.MaxPool2d(2))
    if stage == num_stages - 1:
        parts += [
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(width, len(CLASSES)),
        ]
    return nn.Sequential(*parts)

"""Images in one folder per class (torchvision's `ImageFolder` layout), with the standard transforms."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from runner.config import Exists, Fraction, PositiveFloat, PositiveInt, Range, Seed
from runner.data.base import DataSource, file_stats, fingerprint, machine_cache, random_split
from runner.errors import ConfigError

# torchvision's IMG_EXTENSIONS
IMAGES = Exists("folder", "a folder with one sub-folder of images per class")  # data.path, data.eval_path
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageFiles(Dataset):
    """`(path, class index)` pairs, read and transformed on access: resize the shorter side to `size`,
    centre-crop to `size` x `size`, scale to [0, 1], normalise by `mean` and `std`, then (with `flip`) a
    horizontal flip with probability 1/2.

    A flip is a function of (`seed`, the epoch the loader set, the sample's index), not of torch's global
    RNG: loaders that fetch a batch ahead, worker processes and a resumed run all flip the same images.
    """

    def __init__(
        self,
        samples: list[tuple[Path, int]],
        size: int,
        mode: str,
        mean: torch.Tensor,
        std: torch.Tensor,
        flip: bool,
        flatten: bool,
        seed: int = 0,
    ) -> None:
        self.samples, self.size, self.mode = samples, size, mode
        self.mean, self.std, self.flip, self.flatten = mean, std, flip, flatten
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        path, target = self.samples[index]
        with Image.open(path) as image:
            image = image.convert(self.mode)
            scale = self.size / min(image.size)
            width, height = (
                max(self.size, round(image.width * scale)),
                max(self.size, round(image.height * scale)),
            )
            image = image.resize((width, height), Image.Resampling.BILINEAR)
            left, top = (width - self.size) // 2, (height - self.size) // 2
            image = image.crop((left, top, left + self.size, top + self.size))
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        channels = len(self.mode)
        tensor = pixels.view(self.size, self.size, channels).permute(2, 0, 1).float() / 255
        tensor = (tensor - self.mean[:, None, None]) / self.std[:, None, None]
        if self.flip and self._coin(index):
            tensor = tensor.flip(-1)
        return {"inputs": tensor.flatten() if self.flatten else tensor, "targets": torch.tensor(target)}

    def _coin(self, index: int) -> bool:
        draw = torch.Generator().manual_seed(hash((self.seed, self.epoch, index)) % 2**63)
        return bool(torch.rand((), generator=draw) < 0.5)


class ImageFolder(DataSource):
    """`path/<class>/<image>` files: the classes are the sub-folder names, sorted (torchvision's
        `ImageFolder` order). Every image is decoded whole before launch (once per machine while the files are
    unchanged: `decode_once`), so a broken or truncated one is refused naming the file.

        Args:
            path: the root folder.
            eval_path: a folder of the same classes for evaluation; None: `eval_fraction` of `path`.
            image_size: the square side images are resized and cropped to.
            grayscale: one channel instead of RGB.
            mean, std: per-channel normalisation (one value each for grayscale).
            random_flip: flip training images horizontally at random (eval images never).
            flatten: give the model `C*H*W` vectors (an MLP) instead of `C x H x W` tensors (a CNN).
            eval_fraction, split_seed: the held-out share of `path` (without `eval_path`), and its seed.
    """

    def __init__(
        self,
        path: Annotated[str, IMAGES],
        eval_path: Annotated[str, IMAGES] | None = None,
        image_size: PositiveInt = 32,
        grayscale: bool = False,
        mean: list[Annotated[float, Range()]] | None = None,  # any real per channel
        std: list[PositiveFloat] | None = None,
        random_flip: bool = True,
        flatten: bool = True,
        eval_fraction: Fraction = 0.2,
        split_seed: Seed = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.mode = "L" if grayscale else "RGB"
        channels = len(self.mode)
        mean = [0.5] * channels if mean is None else list(mean)
        std = [0.5] * channels if std is None else list(std)
        if len(mean) != channels or len(std) != channels:
            raise ConfigError(
                f"data.mean={mean}, data.std={std}: give {channels} value(s) each (one per channel of "
                f"{'grayscale' if grayscale else 'RGB'} images)."
            )
        if any(s <= 0 for s in std):
            raise ConfigError(f"data.std={std}: every value must be > 0.")
        if image_size < 1:
            raise ConfigError(f"data.image_size={image_size}: must be >= 1.")
        for key, folder in (("data.path", path), ("data.eval_path", eval_path)):  # after the settings' own
            if (problem := IMAGES.problem(key, folder)) is not None:
                raise ConfigError(problem)
        self.root = Path(path).expanduser()
        self.eval_root = Path(eval_path).expanduser() if eval_path is not None else None
        self.image_size, self.random_flip, self.flatten = image_size, random_flip, flatten
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)
        self.eval_fraction, self.split_seed = eval_fraction, split_seed

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        classes = sorted(entry.name for entry in self.root.iterdir() if entry.is_dir())
        if len(classes) < 2:
            raise ConfigError(
                f"data.path={str(self.root)!r}: {len(classes)} class folder(s) ({classes}); an image classifier needs "
                "at least two, each a sub-folder of images."
            )
        samples = self._samples(self.root, classes)
        if self.eval_root is None:
            train_part, eval_part = random_split(samples, self.eval_fraction, self.split_seed)
            train_samples = [samples[i] for i in train_part.indices]
            eval_samples = [samples[i] for i in eval_part.indices]
        else:
            unseen = sorted(
                {entry.name for entry in self.eval_root.iterdir() if entry.is_dir()} - set(classes)
            )
            if unseen:  # its images would be skipped, and the eval metrics read as if they were all there
                raise ConfigError(
                    f"data.eval_path={str(self.eval_root)!r}: holds the class folder(s) {unseen} that data.path "
                    f"lacks; the model learns only data.path's classes ({', '.join(classes)}). Remove them from "
                    "the eval folder, or add them, with images, to data.path."
                )
            train_samples, eval_samples = samples, self._samples(self.eval_root, classes)
        train, eval_ = self._images(train_samples, self.random_flip), self._images(eval_samples, flip=False)
        channels = len(self.mode)
        dims = {"in_channels": channels, "out_features": len(classes), "num_classes": len(classes)}
        if self.flatten:
            dims["in_features"] = channels * self.image_size**2
        else:
            self.withheld = {
                "in_features": (
                    f"data.flatten=false gives {channels} x {self.image_size} x {self.image_size} image tensors (for a "
                    "model that takes images, a CNN), not vectors of features. Set data.flatten=true for a model that "
                    "takes vectors (model=mlp)"
                )
            }
        return train, eval_, dims

    def _images(self, samples: list[tuple[Path, int]], flip: bool) -> ImageFiles:
        return ImageFiles(
            samples, self.image_size, self.mode, self.mean, self.std, flip, self.flatten, self.split_seed
        )

    def _samples(self, root: Path, classes: list[str]) -> list[tuple[Path, int]]:
        samples = []
        for index, name in enumerate(classes):
            folder = root / name
            if not folder.is_dir():
                raise ConfigError(
                    f"data.eval_path={str(root)!r}: no folder for the class {name!r} of data.path."
                )
            files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
            if not files:
                raise ConfigError(f"{folder}: no images ({', '.join(EXTENSIONS)}) in this class folder.")
            samples += [(file, index) for file in files]
        decode_once(file for file, _ in samples)
        return samples


def decode_once(files: Iterable[Path]) -> None:
    """Decode every image in full (a truncated file has a whole header and fails only when its pixels are
    read, mid-training); ConfigError naming the first that fails. Done once per machine for the same
    files (names, sizes, times): a marker in `machine_cache("images")` records that they decoded."""
    files = list(files)
    marker = machine_cache("images") / f"{fingerprint(file_stats(files))}.decoded"
    if marker.is_file():
        return
    for file in files:
        try:
            with Image.open(file) as image:
                image.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as err:  # SyntaxError: PIL's broken chunk
            raise ConfigError(f"{file}: not a readable image ({err}). Remove or replace it.") from None
        except Image.DecompressionBombError as err:
            raise ConfigError(
                f"{file}: too large to decode ({err}). Shrink or remove it; if you trust the file, raise Pillow's "
                "limit (PIL.Image.MAX_IMAGE_PIXELS) in your own code."
            ) from None
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # no cache: the next process decodes them again
        pass

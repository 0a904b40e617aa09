"""Image transformers (``fuel.transformers.image``) in numpy only, without PIL or Cython.

Images are ``(height, width)`` or ``(channels, height, width)`` arrays; a batch is a
4-d ``(batch, channels, height, width)`` array, or a list (or object array) of images
that may differ in size. Random transformers take ``rng`` and implement ``reseed``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from producer.errors import ConfigError, ShapeError
from producer.schemes import RngLike
from producer.transformers.base import RandomStateMixin, SourcewiseTransformer

__all__ = [
    "MinimumImageDimensions",
    "Random2DRotation",
    "RandomFixedSizeCrop",
    "resize",
    "rotate",
]

log = logging.getLogger(__name__)

_RESAMPLE = ("nearest", "bilinear")


def _check_resample(resample: str) -> str:
    if resample not in _RESAMPLE:
        raise ConfigError(f"resample={resample!r} is not valid: expected one of {_RESAMPLE}")
    return resample


def _check_image(image: Any, what: str) -> np.ndarray:
    array = np.asarray(image)
    if array.ndim not in (2, 3):
        raise ShapeError(
            f"{what}: expected an image of shape (height, width) or (channels, height, "
            f"width), got shape {array.shape}"
        )
    return array


def _sample(image: np.ndarray, rows: np.ndarray, cols: np.ndarray, resample: str) -> np.ndarray:
    """Read ``image`` (last two axes) at fractional ``rows``/``cols``; outside reads 0."""
    height, width = image.shape[-2:]
    if resample == "nearest":
        r = np.floor(rows + 0.5).astype(np.intp)
        c = np.floor(cols + 0.5).astype(np.intp)
        inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
        out = image[..., np.clip(r, 0, height - 1), np.clip(c, 0, width - 1)]
        return np.where(inside, out, 0).astype(image.dtype, copy=False)
    r0, c0 = np.floor(rows).astype(np.intp), np.floor(cols).astype(np.intp)
    fr, fc = rows - r0, cols - c0
    total = np.zeros(image.shape[:-2] + rows.shape, dtype=np.float64)
    for dr, dc, weight in ((0, 0, (1 - fr) * (1 - fc)), (0, 1, (1 - fr) * fc),
                           (1, 0, fr * (1 - fc)), (1, 1, fr * fc)):  # fmt: skip
        r, c = r0 + dr, c0 + dc
        inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
        values = image[..., np.clip(r, 0, height - 1), np.clip(c, 0, width - 1)]
        total += np.where(inside, values, 0) * weight
    if np.issubdtype(image.dtype, np.integer):
        info = np.iinfo(image.dtype)
        return np.clip(np.rint(total), info.min, info.max).astype(image.dtype)
    return total.astype(image.dtype, copy=False)


def resize(image: np.ndarray, shape: tuple[int, int], resample: str = "nearest") -> np.ndarray:
    """Resize the last two axes of ``image`` to ``shape`` (pixel centres aligned)."""
    height, width = image.shape[-2:]
    rows = (np.arange(shape[0]) + 0.5) * height / shape[0] - 0.5
    cols = (np.arange(shape[1]) + 0.5) * width / shape[1] - 0.5
    # Clamp to the edge pixels: resizing never pads with zeros.
    rows, cols = np.clip(rows, 0, height - 1), np.clip(cols, 0, width - 1)
    grid_r, grid_c = np.meshgrid(rows, cols, indexing="ij")
    return _sample(image, grid_r, grid_c, resample)


def rotate(image: np.ndarray, angle: float, resample: str = "nearest") -> np.ndarray:
    """Rotate the last two axes of ``image`` counter-clockwise by ``angle`` radians.

    The image keeps its shape and rotates about its centre; pixels that come from
    outside the input are 0 (as PIL's ``Image.rotate``).
    """
    height, width = image.shape[-2:]
    centre_r, centre_c = (height - 1) / 2, (width - 1) / 2
    out_r, out_c = np.meshgrid(
        np.arange(height) - centre_r, np.arange(width) - centre_c, indexing="ij"
    )
    cos, sin = math.cos(angle), math.sin(angle)
    # Inverse map: which input pixel lands on each output pixel (rows point down).
    cols = centre_c + out_c * cos - out_r * sin
    rows = centre_r + out_c * sin + out_r * cos
    return _sample(image, rows, cols, resample)


class _ImageTransformer(SourcewiseTransformer):
    """Applies :meth:`_transform_image` to each image of the selected sources."""

    def __init__(self, data_stream: Any, **kwargs: Any) -> None:
        if data_stream.axis_labels:
            kwargs.setdefault("axis_labels", dict(data_stream.axis_labels))
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def transform_source_example(self, source_example: Any, source_name: str) -> np.ndarray:
        """Transform one image."""
        return self._transform_image(_check_image(source_example, type(self).__name__))

    def transform_source_batch(self, source_batch: Any, source_name: str) -> Any:
        """Transform each image; a 4-d array stays an array if the shapes allow it."""
        images = [self.transform_source_example(im, source_name) for im in source_batch]
        as_array = isinstance(source_batch, np.ndarray) and source_batch.dtype != object
        if as_array and len({im.shape for im in images}) <= 1:
            return np.stack(images) if images else source_batch
        return images


class MinimumImageDimensions(_ImageTransformer):
    """Upsamples images smaller than a minimum size, keeping their aspect ratio.

    Args:
        data_stream: the wrapped stream.
        minimum_shape: the ``(height, width)`` every image must at least have.
        resample: ``'nearest'`` (default) or ``'bilinear'``.
        **kwargs: ``which_sources``, ``axis_labels``.
    """

    def __init__(
        self,
        data_stream: Any,
        minimum_shape: Sequence[int],
        resample: str = "nearest",
        **kwargs: Any,
    ) -> None:
        if len(minimum_shape) != 2 or min(minimum_shape) < 1:
            raise ConfigError(f"minimum_shape={minimum_shape!r}: expected (height, width) >= 1")
        self.minimum_shape = (int(minimum_shape[0]), int(minimum_shape[1]))
        self.resample = _check_resample(resample)
        super().__init__(data_stream, **kwargs)

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        min_height, min_width = self.minimum_shape
        height, width = image.shape[-2:]
        if height >= min_height and width >= min_width:
            return image
        aspect = width / height
        if width < min_width:
            width, height = min_width, int(min_width / aspect)
        # Not elif: the height that keeps the aspect ratio may still be too small.
        if height < min_height:
            height, width = min_height, int(min_height * aspect)
        return resize(image, (max(height, min_height), max(width, min_width)), self.resample)


class RandomFixedSizeCrop(RandomStateMixin, _ImageTransformer):
    """Crops a window of fixed size at a random position of each image.

    Args:
        data_stream: the wrapped stream.
        window_shape: the ``(height, width)`` of the crops.
        rng: None, an int seed, or a numpy Generator/RandomState.
        **kwargs: ``which_sources``, ``axis_labels``.

    Raises:
        ShapeError: (when reading) an image is smaller than the window.
    """

    def __init__(
        self, data_stream: Any, window_shape: Sequence[int], rng: RngLike = None, **kwargs: Any
    ) -> None:
        if len(window_shape) != 2 or min(window_shape) < 1:
            raise ConfigError(f"window_shape={window_shape!r}: expected (height, width) >= 1")
        self.window_shape = (int(window_shape[0]), int(window_shape[1]))
        self._init_random_state(rng)
        super().__init__(data_stream, **kwargs)

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        win_h, win_w = self.window_shape
        height, width = image.shape[-2:]
        if height < win_h or width < win_w:
            raise ShapeError(
                f"RandomFixedSizeCrop: image of shape {image.shape} is smaller than the "
                f"window {self.window_shape}"
            )
        top = int(self.rng.integers(0, height - win_h + 1))
        left = int(self.rng.integers(0, width - win_w + 1))
        return image[..., top : top + win_h, left : left + win_w]


class Random2DRotation(RandomStateMixin, _ImageTransformer):
    """Rotates each image by a random angle in ``[-maximum_rotation, maximum_rotation]``.

    Args:
        data_stream: the wrapped stream.
        maximum_rotation: the largest rotation, in radians (default pi).
        resample: ``'nearest'`` (default) or ``'bilinear'``.
        rng: None, an int seed, or a numpy Generator/RandomState.
        **kwargs: ``which_sources``, ``axis_labels``.
    """

    def __init__(
        self,
        data_stream: Any,
        maximum_rotation: float = math.pi,
        resample: str = "nearest",
        rng: RngLike = None,
        **kwargs: Any,
    ) -> None:
        if not 0 <= maximum_rotation <= math.pi:
            raise ConfigError(f"maximum_rotation={maximum_rotation!r}: expected 0 to pi radians")
        self.maximum_rotation = float(maximum_rotation)
        self.resample = _check_resample(resample)
        self._init_random_state(rng)
        super().__init__(data_stream, **kwargs)

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        angle = float(self.rng.uniform(-self.maximum_rotation, self.maximum_rotation))
        return rotate(image, angle, self.resample)

"""Image transformers (``fuel.transformers.image``) in numpy only, without PIL or Cython.

Images are ``(height, width)`` or ``(channels, height, width)`` arrays (the random
transformers need ``(channels, height, width)``, as Fuel's); a batch is a 4-d
``(batch, channels, height, width)`` array, or a list (or object array) of images that
may differ in size. Random transformers take ``rng`` and implement ``reseed`` (see
:mod:`producer.randomness`); given a RandomState they make Fuel's draws in Fuel's order.
Rotations and resizes are computed in numpy, so pixels differ slightly from PIL's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from producer.errors import ConfigError, ImageDimensionsError, ShapeError
from producer.randomness import RandomStateMixin, RngLike
from producer.transformers.base import ExpectsAxisLabels, SourcewiseTransformer

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
        raise ImageDimensionsError(
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


def _check_chw(image: Any, what: str) -> np.ndarray:
    """A ``(channels, height, width)`` array, or a ShapeError (Fuel's ValueError)."""
    if not isinstance(image, np.ndarray) or image.ndim != 3:
        shape = getattr(image, "shape", type(image).__name__)
        raise ShapeError(
            f"{what}: uninterpretable example format; expected an ndarray of shape "
            f"(channels, height, width), got {shape}"
        )
    return image


def _batch_images(source_batch: Any, what: str) -> list[np.ndarray] | None:
    """The images of a list / object-array batch, or None for a 4-d array batch."""
    if isinstance(source_batch, np.ndarray) and source_batch.dtype != object:
        if source_batch.ndim != 4:
            raise ShapeError(
                f"{what}: uninterpretable batch format; expected a list of arrays of "
                f"shape (channels, height, width), or an array with 4 axes, got shape "
                f"{source_batch.shape}"
            )
        return None
    return [_check_chw(image, what) for image in source_batch]


class _RandomImageTransformer(RandomStateMixin, ExpectsAxisLabels, _ImageTransformer):
    """Checks axis labels as Fuel does, then draws in Fuel's order."""

    def _labels(self, source_name: str) -> Any:
        return (self.data_stream.axis_labels or {}).get(source_name)

    def transform_source_example(self, source_example: Any, source_name: str) -> np.ndarray:
        """Transform one ``(channels, height, width)`` image."""
        self.verify_axis_labels(
            ("channel", "height", "width"), self._labels(source_name), source_name
        )
        return self._transform_image(_check_chw(source_example, type(self).__name__))

    def _verify_batch(self, source_name: str) -> None:
        self.verify_axis_labels(
            ("batch", "channel", "height", "width"), self._labels(source_name), source_name
        )


class RandomFixedSizeCrop(_RandomImageTransformer):
    """Crops a window of fixed size at a random position of each image.

    Draws as Fuel's: for one image, the top offset (only if the image is taller than
    the window) then the left offset (only if wider); for a 4-d batch, all the left
    offsets, then all the top offsets.

    Args:
        data_stream: the wrapped stream.
        window_shape: the ``(height, width)`` of the crops.
        rng: a RandomState (Fuel's draws), or None, an int seed or a Generator.
        **kwargs: ``which_sources``, ``axis_labels``.

    Raises:
        ShapeError: (when reading; a ``ValueError``) an image is not ``(channels,
            height, width)``, or is smaller than the window.
    """

    def __init__(
        self, data_stream: Any, window_shape: Sequence[int], rng: RngLike = None, **kwargs: Any
    ) -> None:
        if len(window_shape) != 2 or min(window_shape) < 1:
            raise ConfigError(f"window_shape={window_shape!r}: expected (height, width) >= 1")
        self.window_shape = (int(window_shape[0]), int(window_shape[1]))
        self.rng = rng
        super().__init__(data_stream, **kwargs)

    def _offsets(self, image_shape: tuple[int, ...]) -> tuple[int, int]:
        win_h, win_w = self.window_shape
        height, width = image_shape[-2:]
        if height < win_h or width < win_w:
            raise ShapeError(
                f"RandomFixedSizeCrop: image of shape {image_shape} is smaller than the "
                f"window {self.window_shape}"
            )
        return height - win_h, width - win_w

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        max_top, max_left = self._offsets(image.shape)
        top = int(self.random_integers(0, max_top)) if max_top > 0 else 0
        left = int(self.random_integers(0, max_left)) if max_left > 0 else 0
        return image[..., top : top + self.window_shape[0], left : left + self.window_shape[1]]

    def transform_source_batch(self, source_batch: Any, source_name: str) -> Any:
        """Crop each image: a 4-d array gives an array, a list (or object array) a list."""
        self._verify_batch(source_name)
        images = _batch_images(source_batch, type(self).__name__)
        if images is not None:
            return [self._transform_image(image) for image in images]
        max_top, max_left = self._offsets(source_batch.shape)
        size = len(source_batch)
        lefts = self.random_integers(0, max_left, size=size)
        tops = self.random_integers(0, max_top, size=size)
        win_h, win_w = self.window_shape
        out = np.empty(source_batch.shape[:2] + self.window_shape, dtype=source_batch.dtype)
        for i, (top, left) in enumerate(zip(tops, lefts, strict=True)):
            out[i] = source_batch[i, :, top : top + win_h, left : left + win_w]
        return out


class Random2DRotation(_RandomImageTransformer):
    """Rotates each image by a random angle in ``[-maximum_rotation, maximum_rotation]``.

    Draws as Fuel's: one angle in degrees per image (a batch draws all its angles at
    once), from ``uniform(-maximum_rotation, maximum_rotation)`` with the maximum in
    degrees; images rotate counter-clockwise by that angle.

    Args:
        data_stream: the wrapped stream.
        maximum_rotation: the largest rotation, in radians, in ``(0, pi]`` (default pi).
        resample: ``'nearest'`` (default) or ``'bilinear'``.
        rng: a RandomState (Fuel's draws), or None, an int seed or a Generator.
        **kwargs: ``which_sources``, ``axis_labels``.

    Attributes:
        maximum_rotation: the largest rotation in degrees, as Fuel stores it.

    Raises:
        ConfigError: (a ``ValueError``) ``maximum_rotation`` is not in ``(0, pi]``.
    """

    def __init__(
        self,
        data_stream: Any,
        maximum_rotation: float = math.pi,
        resample: str = "nearest",
        rng: RngLike = None,
        **kwargs: Any,
    ) -> None:
        if not 0 < maximum_rotation <= math.pi:
            raise ConfigError(
                f"maximum_rotation={maximum_rotation!r} is not valid: expected a value in "
                "(0, pi] radians (to leave images unrotated, leave this transformer out)"
            )
        self.maximum_rotation = float(np.rad2deg(maximum_rotation))
        self.resample = _check_resample(resample)
        self.rng = rng
        super().__init__(data_stream, **kwargs)

    def _rotate(self, image: np.ndarray, degrees: float) -> np.ndarray:
        return rotate(image, math.radians(float(degrees)), self.resample)

    def _transform_image(self, image: np.ndarray) -> np.ndarray:
        return self._rotate(image, self.uniform(-self.maximum_rotation, self.maximum_rotation))

    def transform_source_batch(self, source_batch: Any, source_name: str) -> Any:
        """Rotate each image; a 4-d array stays an array, a list stays a list."""
        self._verify_batch(source_name)
        images = _batch_images(source_batch, type(self).__name__)
        angles = self.uniform(-self.maximum_rotation, self.maximum_rotation, len(source_batch))
        if images is None:
            return np.array(
                [self._rotate(im, a) for im, a in zip(source_batch, angles, strict=True)],
                dtype=source_batch.dtype,
            ).reshape(source_batch.shape)
        rotated = [self._rotate(im, a) for im, a in zip(images, angles, strict=True)]
        if isinstance(source_batch, np.ndarray):
            out = np.empty(len(rotated), dtype=object)
            for i, image in enumerate(rotated):
                out[i] = image
            return out
        return rotated

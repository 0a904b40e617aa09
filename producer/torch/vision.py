"""Importing torchvision beside a CPU build of torch whose torchvision wheel is CUDA's.

PyPI's torchvision 0.28.0 (for torch 2.13.0) is built against CUDA torch: its C++ ops
(``torchvision/_C.so``) need ``libtorch_cuda.so``, which the CPU build lacks, so they
do not load, and ``import torchvision`` then fails in ``_meta_registrations`` with
``operator torchvision::nms does not exist`` (every other registration there checks
whether the ops loaded; the two fake kernels of ``nms`` and ``qnms`` do not).

:func:`import_torchvision` imports torchvision; on that one failure it declares the two
operators' schemas (no kernel) and imports again. What works then is everything written
in Python over torch and PIL: ``datasets.ImageFolder``, ``transforms.v2``, the models;
what does not: torchvision's C++ ops (``ops.nms``, ``roi_align``, ... raise), and its
own image decoders (PIL decodes instead, which is ImageFolder's default). Where the C++
ops load (a matching build), nothing is declared.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["import_torchvision"]

# The operators whose fake kernels torchvision registers without checking that its C++
# ops loaded, with their schemas (torchvision/csrc/ops/nms.cpp, quantized/qnms).
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # kept alive: a Library's definitions go when it is collected


def import_torchvision() -> ModuleType:
    """``import torchvision``, declaring the missing operators first where needed.

    Raises:
        ImportError: torchvision is not installed, or fails for another reason.
    """
    global _library
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e) or _library is not None:
            raise ImportError(f"torchvision cannot be imported: {e}") from e
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported package, so it imports afresh
        import torch

        _library = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
        for schema in _SCHEMAS:
            _library.define(schema)
        import torchvision
    module: ModuleType = torchvision
    return module

"""Tests run Triton kernels in its CPU interpreter unless a GPU is present (then compiled kernels run on CUDA).

The switch must happen before triton is first imported: Triton picks interpreted or compiled at decoration
time. Set TRITON_INTERPRET=1 yourself to force the interpreter on a GPU machine.

Tests marked `slow` take seconds to minutes on 2 CPU cores, mostly Triton's interpreter; a plain `pytest`
leaves them out (pyproject.toml's addopts) and CI runs them. With a GPU they run compiled and quickly, and the
GPU run is the one that checks them compiled, so there the default selection takes them too.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    if torch.cuda.is_available() and config.option.markexpr == "not slow":
        config.option.markexpr = ""

"""Tests run Triton kernels in its CPU interpreter unless a GPU is present (then compiled kernels run on CUDA).

The switch must happen before triton is first imported: Triton picks interpreted or compiled at decoration
time. Set TRITON_INTERPRET=1 yourself to force the interpreter on a GPU machine.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

"""Without CUDA the kernels run under Triton's interpreter, which must be chosen before they are defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

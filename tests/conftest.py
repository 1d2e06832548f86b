"""Test-wide set-up: Triton kernels run in the interpreter, debug checks on, small thread pools."""

import os

# Must be set before anything imports triton: @triton.jit decides at decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HELEXA_DEBUG", "1")

import torch  # noqa: E402

torch.manual_seed(0)

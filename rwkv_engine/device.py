"""Which device a model runs on: "auto", "cpu", "cuda", "cuda:N" resolved and checked once.

`resolve_device("auto")` is CUDA where torch sees a GPU, else the CPU. Asking for CUDA on a torch
without it (a CPU build, no driver, no GPU) is an InputError naming the reason, not the
AssertionError torch raises when the first tensor moves.
"""

from __future__ import annotations

import torch

from .errors import InputError

# Device kinds the CLI's --device takes (plus "cuda:N"); the API takes any torch device.
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch finds no CUDA GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)"
    return None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch.device for `device` ("auto"/None: CUDA when available, else the CPU); InputError
    for a name torch does not know and for a CUDA device that does not exist here."""
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if cuda_problem() is None else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"device: {e}") from None
    if dev.type == "cuda":
        problem = cuda_problem()
        if problem is not None:
            raise InputError(f"device {dev}: CUDA is not available: {problem}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {dev}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def cuda_dtype(device: torch.device | None = None) -> torch.dtype:
    """The 16-bit type for `--dtype auto` on a CUDA device: bf16, or fp16 where it lacks bf16 (pre-Ampere)."""
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

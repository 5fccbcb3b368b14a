"""When a kernel needs its autograd Function: only if a backward will run through it.

Calling a `torch.autograd.Function` costs ~50 us on CPU, more than a small op itself, so the kernels run the
same forward ops directly when this says no (sampling, `forward`, anything under `torch.no_grad()`).
"""

import torch


def grad_wanted(*tensors: torch.Tensor | None) -> bool:
    """Grad mode is on and one of `tensors` (None entries skipped) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

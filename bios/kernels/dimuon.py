"""Dimuon: an orthogonalised-momentum step for LoRA factor matrices.

Tinker documents Dimuon by its hyperparameters only (tinker.types.DimuonParams, tinker 0.38 docs): the learning
rate "applied to a direction with Frobenius norm sqrt(rank)", "damping that smooths the row and column
preconditioner", a "matrix-sign iteration", a "rank correction relative to rank 32". Its exact algorithm is not
public, so this is Bios's own reading of those words, the Muon update (Jordan et al. 2024) applied to each LoRA
factor with a damped matrix sign:

    G      = grad, scaled by min(1, grad_clip_norm / (||grad||_global + 1e-6)) when grad_clip_norm > 0
    M     <- beta1 * M + (1 - beta1) * G                              (per factor; kept in `exp_avg`)
    N      = M / (||M||_F + 1e-12)                                    (per factor, per expert)
    D      = (N N^T + damping * I)^(-1/2) N    if N is wide (rows <= cols, e.g. A [rank, in])
           = N (N^T N + damping * I)^(-1/2)    if N is tall (B [out, rank])
    W     <- W - learning_rate * (32 / rank) ** rank_lr_correction_exponent * D

D is the damped matrix sign of the momentum: with damping -> 0 it is the polar factor U V^T of N = U S V^T,
whose Frobenius norm is sqrt(rank), so `learning_rate` is the step along a direction of norm sqrt(rank), as
Tinker says; damping shrinks the directions of singular values below sqrt(damping) (each singular value s maps
to s / sqrt(s^2 + damping)), i.e. it smooths the two-sided (row and column) preconditioner
(N N^T)^(-1/4) N (N^T N)^(-1/4) that the matrix sign equals. Instead of a Newton-Schulz iteration, the inverse
square root is taken exactly from the eigendecomposition of the rank x rank Gram matrix (float64): LoRA factors
have one side of size rank, so this is cheap, and it is deterministic, so data-parallel replicas stay identical.
The normalisation makes the step independent of the gradient's scale, so no bias correction is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bios.kernels.adamw import _CLIP_NORM_EPS

REFERENCE_RANK = 32  # the rank at which the rank correction is 1
_NORMALISE_EPS = 1e-12


@torch.no_grad()
def damped_sign(momentum: Tensor, damping: float) -> Tensor:
    """D of the module docstring for a factor [..., m, n] (leading dims: experts), in the factor's dtype."""
    n = momentum.double()
    n = n / (torch.linalg.matrix_norm(n, keepdim=True) + _NORMALISE_EPS)
    wide = n.shape[-2] <= n.shape[-1]
    gram = n @ n.mT if wide else n.mT @ n
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    inverse_root = (eigenvectors * (eigenvalues.clamp(min=0) + damping).rsqrt().unsqueeze(-2)) @ eigenvectors.mT
    return (inverse_root @ n if wide else n @ inverse_root).to(momentum.dtype)


@torch.no_grad()
def dimuon_step(
    factors: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    flat_grad: Tensor,
    *,
    rank: int,
    lr: float,
    beta1: float,
    damping: float,
    rank_lr_correction_exponent: float,
    grad_clip_norm: float,
) -> float:
    """Update every factor and its momentum in place (views into the adapter's flat buffers); return the
    gradient's global L2 norm before clipping. `flat_grad` is the whole gradient the factor grads are views of."""
    grad_norm = float(torch.linalg.vector_norm(flat_grad))
    if grad_clip_norm > 0:
        flat_grad.mul_(min(1.0, grad_clip_norm / (grad_norm + _CLIP_NORM_EPS)))
    step_size = lr * (REFERENCE_RANK / rank) ** rank_lr_correction_exponent
    for factor, grad, momentum in zip(factors, grads, momenta, strict=True):
        momentum.lerp_(grad, 1 - beta1)
        factor.sub_(damped_sign(momentum, damping), alpha=step_size)
    return grad_norm

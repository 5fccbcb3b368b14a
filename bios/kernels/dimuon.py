"""Dimuon: an orthogonalised-momentum step for LoRA factor matrices.

Tinker documents Dimuon by its hyperparameters only (tinker.types.DimuonParams, tinker 0.38 docs): the learning
rate "applied to a direction with Frobenius norm sqrt(rank)", "damping that smooths the row and column
preconditioner", a "matrix-sign iteration", a "rank correction relative to rank 32". Its exact algorithm is not
public, so this is Bios's own reading of those words, the Muon update (Jordan et al. 2024) applied to each LoRA
factor with a damped matrix sign:

    G      = grad, scaled by min(1, grad_clip_norm / (||grad||_global + 1e-6)) when grad_clip_norm > 0
    M     <- beta1 * M + (1 - beta1) * G                              (per factor; kept in `exp_avg`)
    N      = M / (||M||_F + 1e-12)                                    (per factor, per expert)
    D      = (N N^T + damping * I)^(-1/2) N    for A [rank, in]
           = N (N^T N + damping * I)^(-1/2)    for B [out, rank]    (the same matrix function of N)
    W     <- W - learning_rate * (32 / rank) ** rank_lr_correction_exponent * D

D is the damped matrix sign of the momentum: with damping -> 0 it is the polar factor U V^T of N = U S V^T,
whose Frobenius norm is sqrt(rank), so `learning_rate` is the step along a direction of norm sqrt(rank), as
Tinker says; damping shrinks the directions of singular values below sqrt(damping) (each singular value s maps
to s / sqrt(s^2 + damping)), i.e. it smooths the two-sided (row and column) preconditioner
(N N^T)^(-1/4) N (N^T N)^(-1/4) that the matrix sign equals. Instead of a Newton-Schulz iteration, the inverse
square root is taken exactly from the eigendecomposition of the rank x rank Gram matrix (float64): LoRA factors
have one side of size rank, so this is cheap, and it is deterministic, so data-parallel replicas stay identical.
The normalisation makes the step independent of the gradient's scale, so no bias correction is needed.

Both forms take the Gram matrix over the rank axis (A's rows, B's columns); it and the squared Frobenius norm
(its trace) are sums over the other axis, so a factor split over tensor-parallel workers along that axis needs
one all-reduce of its Gram matrix (`reduce`), taken for every factor before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from bios.kernels.adamw import _CLIP_NORM_EPS

REFERENCE_RANK = 32  # the rank at which the rank correction is 1
_NORMALISE_EPS = 1e-12


@dataclass(frozen=True)
class DimuonFactor:
    """One LoRA factor's views into the adapter's flat buffers. `rank_rows`: A ([..., rank, in]) rather than B
    ([..., out, rank]); `split`: this worker holds a tensor-parallel slice of it along its non-rank axis."""

    param: Tensor
    grad: Tensor
    momentum: Tensor
    rank_rows: bool
    split: bool = False


def rank_gram(matrix: Tensor, rank_rows: bool) -> Tensor:
    """The Gram matrix over the rank axis, float64: [..., rank, rank]."""
    m = matrix.double()
    return m @ m.mT if rank_rows else m.mT @ m


@torch.no_grad()
def damped_sign(momentum: Tensor, damping: float, rank_rows: bool, gram: Tensor | None = None) -> Tensor:
    """D of the module docstring for a factor [..., m, n] (leading dims: experts), in the factor's dtype.
    `gram`: its rank-axis Gram matrix when already taken (summed over tensor-parallel slices)."""
    m = momentum.double()
    gram = rank_gram(momentum, rank_rows) if gram is None else gram
    scale = 1.0 / (gram.diagonal(dim1=-2, dim2=-1).sum(-1).sqrt() + _NORMALISE_EPS)  # 1 / ||M||_F
    eigenvalues, eigenvectors = torch.linalg.eigh(gram * scale[..., None, None] ** 2)
    inverse_root = (eigenvectors * (eigenvalues.clamp(min=0) + damping).rsqrt().unsqueeze(-2)) @ eigenvectors.mT
    n = m * scale[..., None, None]
    return (inverse_root @ n if rank_rows else n @ inverse_root).to(momentum.dtype)


@torch.no_grad()
def dimuon_step(
    factors: list[DimuonFactor],
    flat_grad: Tensor,
    *,
    rank: int,
    lr: float,
    beta1: float,
    damping: float,
    rank_lr_correction_exponent: float,
    grad_clip_norm: float,
    grad_norm: float | None = None,
    reduce: Callable[[Tensor], None] | None = None,
) -> float:
    """Update every factor and its momentum in place; return the gradient's global L2 norm before clipping.

    `flat_grad` is the gradient the factor grads are views of; `grad_norm` the whole gradient's norm when these
    factors are a tensor-parallel shard of it (by default `flat_grad`'s). `reduce` sums a tensor in place over
    the tensor-parallel group; split factors need it. Nothing changes until every Gram matrix is in, so a failed
    collective leaves the adapter as it was.
    """
    grad_norm = float(torch.linalg.vector_norm(flat_grad)) if grad_norm is None else grad_norm
    clip = min(1.0, grad_clip_norm / (grad_norm + _CLIP_NORM_EPS)) if grad_clip_norm > 0 else 1.0
    momenta = [f.momentum.lerp(f.grad * clip, 1 - beta1) for f in factors]
    grams = [rank_gram(m, f.rank_rows) for m, f in zip(momenta, factors)]
    split = [i for i, f in enumerate(factors) if f.split]
    if split:
        if reduce is None:
            raise ValueError("split Dimuon factors need the tensor-parallel group's sum (`reduce`)")
        joined = torch.cat([grams[i].reshape(-1) for i in split])
        reduce(joined)
        for i, part in zip(split, joined.split([grams[i].numel() for i in split])):
            grams[i] = part.view_as(grams[i])
    step_size = lr * (REFERENCE_RANK / rank) ** rank_lr_correction_exponent
    for factor, momentum, gram in zip(factors, momenta, grams):
        factor.momentum.copy_(momentum)
        factor.param.sub_(damped_sign(momentum, damping, factor.rank_rows, gram), alpha=step_size)
    return grad_norm

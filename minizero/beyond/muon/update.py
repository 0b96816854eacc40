"""Muon's update for one matrix, in its three parts: which of them need the whole matrix.

    python -m pytest tests/test_muon.py -k update

torch.optim.Muon (torch 2.13; Keller Jordan's Muon) steps a 2-D parameter W [m, n] with gradient G:

    B <- μ·B + (1 - μ)·G                 momentum: element by element        (momentum_and_nesterov)
    U <- (1 - μ)·G + μ·B  (nesterov)     element by element
    O <- NS(U)                           Newton-Schulz: the WHOLE matrix     (newton_schulz)
    W <- W·(1 - lr·λ) - lr'·O            element by element                  (apply_update)

NS(U) is the orthogonal factor of U (U = P·S·Q^T -> ~P·Q^T, every singular value pushed to ~1) by
five steps of a quintic polynomial, X <- a·X + (b·A + c·A²)·X with A = X·X^T, in bf16. Every entry
of O depends on every entry of U: that is what ZeRO's element-wise partitions break. Cut U into
slices and orthogonalize each, and each slice comes out orthogonal by itself, which the whole is
not: a different O, a different model (tests/test_muon.py measures how different). The other parts
are element-wise, as Adam is: a rank can apply them to any slice of W it owns. So a partitioned
Muon keeps the momentum B by element (P_os, like Adam's moments) and only has to bring U's slices
together for NS: the designs beside this file say how.

lr' = lr·sqrt(max(1, m/n)) (adjust_lr_fn None or "original"; 0.2·lr·sqrt(max(m, n)) for
"match_rms_adamw") uses the matrix's shape: a slice must use its whole matrix's. Written from
torch.optim.Muon's documented algorithm; tests/test_muon.py checks it equals torch's step bit for
bit.
"""

from __future__ import annotations

import math

import torch


def momentum_and_nesterov(buffer: torch.Tensor, grad: torch.Tensor, momentum: float,
                          nesterov: bool) -> torch.Tensor:
    """B <- lerp(B, G, 1 - μ) in place; returns U, what NS orthogonalizes. Any slice, any shape."""
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if nesterov else buffer


def newton_schulz(u: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """The orthogonal factor of a WHOLE matrix u [m, n]: [m, n] in bf16 (torch's precision)."""
    if u.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalizes a whole matrix, got shape {tuple(u.shape)}")
    a, b, c = coefficients
    tall = u.size(0) > u.size(1)
    x = u.bfloat16()
    if tall:
        x = x.T                                           # work on the wide side: A is min(m, n)²
    x.div_(x.norm().clamp(min=eps))                       # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T                                                 # A = X·X^T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)          # b·A + c·A²
        x = torch.addmm(x, poly, x, beta=a)                            # a·X + (b·A + c·A²)·X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """lr' for a matrix of `shape` (its whole shape, never a slice's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def apply_update(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                 lr_for_shape: float) -> None:
    """W <- W·(1 - lr·λ) - lr'·O, in place on any slice of W and the same slice of O."""
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr_for_shape)


def orthogonalized(u: torch.Tensor, group: dict) -> torch.Tensor:
    """NS of a whole matrix with its parameter group's settings (torch.optim.Muon's keys)."""
    return newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"])

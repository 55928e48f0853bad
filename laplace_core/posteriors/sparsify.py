"""Spectral sparsification, Algorithm 1 of Lee et al. (2020), docs/design.md §1.

The EFB eigenvalues of one layer form an ``m x n`` matrix ``Λ`` (entry ``[i, j]``
belongs to the eigenvector pair ``(U_G[:, i], U_A[:, j])``). Keeping the ``K``
largest entries with a Kronecker-structured eigenbasis requires keeping every
pair of their eigenvectors: with ``I`` the distinct rows and ``J`` the distinct
columns of the top-``K`` entries, the kept set is the full cross product
``I x J`` (``L = |I| |J| >= K``; in the paper's toy example the top 3 of a
``2 x 3`` Kronecker spectrum keep 4 eigenvalues).
"""
from __future__ import annotations

import numbers

import torch

__all__ = ["sparsify"]


def sparsify(lam: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``I`` and columns ``J`` kept by Algorithm 1.

    ``lam``: ``(m, n)`` eigenvalue matrix; ``k``: number of top entries, ``1 <= k``
    (``k >= m n`` keeps everything). Returns ``(rows, cols)``, sorted ``int64``
    tensors on ``lam``'s device; the kept eigenvalues are ``lam[rows][:, cols]``.

    Ties are broken deterministically: entries are ranked by value (descending),
    then by row, then by column (ascending), with a stable sort.
    """
    if lam.dim() != 2:
        raise ValueError(f"sparsify expects an m x n eigenvalue matrix, got shape {tuple(lam.shape)}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"sparsify: k must be a positive int, got {k!r}")
    if not torch.isfinite(lam).all():
        raise ValueError("sparsify: eigenvalue matrix contains NaN or Inf")
    k, (m, n) = int(k), lam.shape
    if k >= m * n:
        dev = lam.device
        return torch.arange(m, device=dev), torch.arange(n, device=dev)
    # Row-major flattening; a stable descending sort keeps (row, col) order among ties.
    order = torch.sort(lam.reshape(-1), descending=True, stable=True).indices[:k]
    rows, cols = torch.unravel_index(order, (m, n))
    return torch.unique(rows), torch.unique(cols)  # unique() returns sorted values

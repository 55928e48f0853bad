"""Closed-form GLM predictive of a last-layer posterior (Kristiadi et al. 2020; Immer et al. 2021).

When the posterior covers only the network's last ``nn.Linear`` (``layers="last"``,
:mod:`laplace_core.curvature.layer_selection`) and that layer's output *is* the model output, the
logits are linear in its ``W~ = [W, b]`` (``m = C`` rows): ``f = W~ φ(x)`` with the
features ``φ(x)`` = the layer input with a bias 1 appended. With column-stacking ``vec``
(docs/design.md §1), ``J(x) = φ(x)^T ⊗ I_C`` exactly (the GLM is the network itself), so the
logit covariance is

    ``Σ_f(x) = (φ^T ⊗ I) Σ (φ ⊗ I)``   (``C x C``; column ``c`` of ``φ ⊗ I`` is ``vec(e_c φ^T)``),

computed per structure from the stored pieces, with no backward pass, no sampling and
no Kronecker product formed (``P`` is the structure's precision, ``Σ = P^{-1}``):

* diag (``P = diag(vec p)``): ``Σ_f = diag_c(Σ_j φ_j² / p_cj)``.
* KFAC (``Σ = A'^{-1} ⊗ G'^{-1}``): ``Σ_f = (φ^T A'^{-1} φ) G'^{-1}`` (Banerjee et al. 2025 eq. 15
  with ``Γ = I``).
* eigenbasis-diagonal (efb, kfac_exact; ``Σ = (U_A ⊗ U_G) diag(vec e)^{-1} (U_A ⊗ U_G)^T``):
  ``Σ_f = U_G diag_i(Σ_j (U_A^T φ)_j² / e_ij) U_G^T``.
* INF (``P = Dp^{1/2} (I + V V^T) Dp^{1/2}``, :mod:`laplace_core.posteriors.structures.inf`): Woodbury,
  ``Σ = Dp^{-1} − Dp^{-1/2} V Q (I+Γ)^{-1} Q^T V^T Dp^{-1/2}``, hence
  ``Σ_f = diag_c(Σ_j φ_j² Dp^{-1}_cj) − M M^T`` with ``M = K Q (I+Γ)^{-1/2}`` (``C x L``) and
  ``K[c, (a,b)] = V^T vec(Dp^{-1/2} ∘ e_c φ^T) = s_ab U_g[c,a] R[c,b]``,
  ``R = (Dp^{-1} ∘ 1 φ^T) U_a`` (``C x |J|``; ``V`` holds the other ``Dp^{-1/2}``). Cost ``O(C n |J| + C L²)`` per input.
* subnet (full ``Σ_S = P_S^{-1}`` over selected entries ``k = (i_k, j_k)`` of ``W~``):
  ``Σ_f[c, d] = Σ_{i_k = c, i_l = d} φ_{j_k} Σ_S[k, l] φ_{j_l}`` (one-hot row sums,
  ``O(S²)`` per input, in blocks).

:class:`LastLayerGLMPredictor` uses ``Σ_f`` with the links of :mod:`laplace_core.predictive.glm`:
``"mc"`` averages ``softmax(f + L_f z_t)`` over Gaussian logits (``L_f L_f^T = Σ_f``,
``z_t ~ N(0, I_C)`` drawn from ``(seed, t)`` and shared by every input, so a batch or shard
sees the same draws: the output-space version of MC-GLM, exact per input because the GLM is
exact here), ``"probit"`` (pairwise mean-field) and ``"probit_pi8"``.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from .glm import probit_pairwise, probit_pi8
from ..curvature.layers import LayerKind, find_layers, is_tapped, layer_kind
from .monte_carlo import check_layers, draw_stats, eval_mode, sample_generator, sample_seed
from ..posteriors.structures.base import LayerPosterior, Posterior
from ..posteriors.structures.diag import DiagLayer
from ..posteriors.structures.efb import EigenDiagLayer
from ..posteriors.structures.inf import InfLayer
from ..posteriors.structures.kron import KronLayer

__all__ = [
    "LINKS",
    "last_linear_layer",
    "last_layer_features",
    "last_layer_covariance",
    "last_layer_glm_covariance",
    "LastLayerGLMPredictor",
]

LINKS = ("mc", "probit", "probit_pi8")
F64 = torch.float64


def _modules(model: nn.Module, modules: Mapping[str, nn.Module] | None) -> dict[str, nn.Module]:
    return dict(find_layers(model, norm_layers="diag")[0] if modules is None else modules)


def _selected(posterior: Posterior) -> list[str]:
    """The posterior's layers that hold weights (a subnet posterior lists every curvature
    layer, also those with nothing selected)."""
    return [k for k, lp in posterior.layers.items() if getattr(lp, "size", 1) > 0]


def last_linear_layer(model: nn.Module, posterior: Posterior,
                      modules: Mapping[str, nn.Module] | None = None) -> str | None:
    """The name of the posterior's single layer when it is a plain ``nn.Linear`` (the closed
    form's candidate; whether its output is the model output is checked on the forward pass
    by :func:`last_layer_features`), else None."""
    names = _selected(posterior)
    if len(names) != 1:
        return None
    mods = _modules(model, modules)
    mod = mods.get(names[0])
    if mod is None or not isinstance(mod, nn.Linear) or is_tapped(mod) or layer_kind(mod) is not LayerKind.LINEAR:
        return None
    return names[0]


def last_layer_features(model: nn.Module, x: torch.Tensor, module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(f(x, θ*) [B, C], φ(x) [B, n])`` with ``φ`` the input of ``module`` (bias 1 appended),
    or None when ``module``'s output is not the model output itself or its input is not
    ``(B, in_features)`` (one position). Eval mode, no autograd."""
    seen: dict[str, torch.Tensor] = {}

    def hook(mod, inputs, output):
        seen["in"], seen["out"] = inputs[0], output

    h = module.register_forward_hook(hook)
    try:
        with torch.no_grad(), eval_mode(model):
            out = model(x)
    finally:
        h.remove()
    if "out" not in seen or seen["out"] is not out or out.dim() != 2 or seen["in"].dim() != 2:
        return None
    phi = seen["in"]
    if module.bias is not None:
        phi = torch.cat([phi, phi.new_ones(phi.shape[0], 1)], dim=1)
    return out, phi


def _per_layer(lp: LayerPosterior, phi: torch.Tensor, max_elements: int) -> torch.Tensor:
    """``(φ^T ⊗ I) Σ_l (φ ⊗ I)`` ``[B, C, C]`` for one block-diagonal layer posterior (float64 ``φ``)."""
    if isinstance(lp, DiagLayer):
        return torch.diag_embed((phi * phi) @ (1.0 / lp.precision.to(F64)).T)
    if isinstance(lp, KronLayer):
        U_A, U_G = lp.U_A.to(F64), lp.U_G.to(F64)
        qa = ((phi @ U_A) ** 2 / lp.a.to(F64)).sum(-1)  # φ^T A'^{-1} φ, (B,)
        Ginv = (U_G / lp.g.to(F64)) @ U_G.T
        return qa[:, None, None] * Ginv
    if isinstance(lp, EigenDiagLayer):
        w = ((phi @ lp.U_A.to(F64)) ** 2) @ (1.0 / lp.eig.to(F64)).T  # (B, C)
        U_G = lp.U_G.to(F64)
        return torch.einsum("ci,bi,di->bcd", U_G, w, U_G)
    if isinstance(lp, InfLayer):
        return _inf(lp, phi, max_elements)
    raise ValueError(f"no last-layer closed form for {type(lp).__name__}")


def _inf(lp: InfLayer, phi: torch.Tensor, max_elements: int) -> torch.Tensor:
    """INF's ``Σ_f`` by Woodbury (module docstring), chunked over inputs."""
    dinv = lp.d_isqrt.to(F64).square()  # Dp^{-1}, C x n
    U_g, U_a, s = lp.U_g.to(F64), lp.U_a.to(F64), lp.s.to(F64)
    W = lp.Q.to(F64) * torch.rsqrt(1.0 + lp.gamma.to(F64))[None, :]  # Q (I+Γ)^{-1/2}, L x L
    C, n = dinv.shape
    nI, nJ = s.shape
    L = nI * nJ
    cov = torch.diag_embed((phi * phi) @ dinv.T)
    bs = max(1, min(phi.shape[0], max_elements // max(1, C * max(n, L))))
    Us = U_g[:, :, None] * s[None]  # (C, |I|, |J|): s_ab U_g[c, a]
    for i0 in range(0, phi.shape[0], bs):
        p = phi[i0:i0 + bs]
        R = torch.einsum("cq,bq,qj->bcj", dinv, p, U_a)  # (b, C, |J|)
        K = (Us[None] * R[:, :, None, :]).reshape(p.shape[0], C, L)
        M = K @ W
        cov[i0:i0 + bs] -= M @ M.transpose(1, 2)
    return cov


def _subnet(post: Posterior, name: str, phi: torch.Tensor, max_elements: int) -> torch.Tensor:
    """Subnet ``Σ_f``: one-hot row sums of ``diag(u) Σ_S diag(u)``, ``u_k = φ_{j_k}``, in
    blocks of inputs and of rows ``k`` of ``Σ_S`` (at most about ``max_elements`` per block)."""
    lp = post.layers[name]
    C = lp.shape[0]
    idx = lp.index.to(phi.device)
    rows, cols = idx % C, idx // C  # vec(W~) is column-stacking: k = j C + i
    Sigma = torch.cholesky_inverse(post.cholesky.to(F64))  # S x S
    u = phi[:, cols]  # (B, S)
    B, S = u.shape
    cov = phi.new_zeros(B, C, C)
    bs = max(1, min(B, max_elements // max(1, S * max(S, C))))
    kb = max(1, min(S, max_elements // max(1, bs * max(S, C))))
    for i0 in range(0, B, bs):
        ub = u[i0:i0 + bs]
        for k0 in range(0, S, kb):
            T = ub[:, k0:k0 + kb, None] * Sigma[k0:k0 + kb][None] * ub[:, None, :]  # (b, kb, S)
            part = phi.new_zeros(ub.shape[0], T.shape[1], C).index_add_(2, rows, T)  # columns -> logits d
            cov[i0:i0 + bs].index_add_(1, rows[k0:k0 + kb], part)  # rows k -> logits c
    return cov


def last_layer_covariance(posterior: Posterior, name: str, phi: torch.Tensor, *,
                          max_elements: int = 2**25) -> torch.Tensor:
    """``Σ_f = (φ^T ⊗ I) Σ (φ ⊗ I)`` ``[B, C, C]`` (float64) for the posterior's layer ``name``
    and features ``φ`` ``[B, n]`` (bias column included); module docstring for each structure."""
    phi = phi.to(F64)
    lp = posterior.layers[name]
    if phi.dim() != 2 or phi.shape[1] != lp.shape[1]:
        raise ValueError(f"features must be (B, {lp.shape[1]}) for layer {name!r}, got {tuple(phi.shape)}")
    if getattr(posterior, "covariance_matvec", None) is not None:  # subnet: the covariance couples entries
        cov = _subnet(posterior, name, phi, max_elements)
    else:
        cov = _per_layer(lp, phi, max_elements)
    return 0.5 * (cov + cov.transpose(1, 2))


def last_layer_glm_covariance(model: nn.Module, posterior: Posterior, x: torch.Tensor, *,
                              modules: Mapping[str, nn.Module] | None = None,
                              max_elements: int = 2**25) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(f(x, θ*) [B, C], Σ_f [B, C, C])`` in closed form when the posterior covers only a last
    ``nn.Linear`` whose output is the model output; None otherwise (use
    :func:`laplace_core.predictive.glm.glm_covariance`, which calls this first)."""
    mods = _modules(model, modules)
    name = last_linear_layer(model, posterior, mods)
    if name is None:
        return None
    got = last_layer_features(model, x, mods[name])
    if got is None:
        return None
    out, phi = got
    lp = posterior.layers[name]
    if tuple(lp.shape) != (out.shape[1], phi.shape[1]):
        return None
    return out, last_layer_covariance(posterior, name, phi, max_elements=max_elements)


def _factor(cov: torch.Tensor) -> torch.Tensor:
    """``L`` with ``L L^T = cov`` per input: Cholesky, or ``U Λ^{1/2}`` (eigh, ``Λ`` clamped at
    0) where ``cov`` is singular (a subnet leaves whole logits at MAP: zero rows)."""
    Lf, info = torch.linalg.cholesky_ex(cov)
    bad = info != 0
    if bool(bad.any()):
        lam, U = torch.linalg.eigh(cov[bad])
        Lf[bad] = U * lam.clamp_min(0.0).sqrt()[:, None, :]
    return Lf


class LastLayerGLMPredictor:
    """Linearised predictive of a last-layer posterior with the closed-form ``Σ_f`` (module docstring).

    ``link``: ``"mc"`` (average ``softmax(f + L_f z_t)``, ``t < n_samples``, ``z_t`` from
    ``(seed, t)``), ``"probit"`` or ``"probit_pi8"``. ``ValueError`` at construction when the
    posterior is not over one ``nn.Linear``; when that layer's output turns out not to be the
    model output (seen on a batch) the batch goes to ``fallback`` (e.g. a
    :class:`laplace_core.predictive.glm.GLMPredictor`), or ``ValueError`` without one.
    """

    def __init__(self, model: nn.Module, posterior: Posterior, n_samples: int = 100, seed: int = 0,
                 link: str = "mc", *, modules: Mapping[str, nn.Module] | None = None, fallback=None,
                 max_elements: int = 2**25):
        if link not in LINKS:
            raise ValueError(f"unknown GLM link {link!r}; valid: {', '.join(LINKS)}")
        if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
            raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
        sample_seed(seed, 0)  # validates seed
        self.model, self.posterior, self.n_samples, self.seed, self.link = model, posterior, n_samples, seed, link
        self.modules = _modules(model, modules)
        check_layers(self.modules, posterior)
        self.name = last_linear_layer(model, posterior, self.modules)
        if self.name is None:
            raise ValueError("the closed-form last-layer GLM needs a posterior over one nn.Linear "
                             f"(the last layer); this one covers {_selected(posterior)[:5]}")
        self._z: torch.Tensor | None = None
        self.fallback = fallback
        if not isinstance(max_elements, int) or max_elements < 1:
            raise ValueError(f"max_elements must be an int >= 1, got {max_elements!r}")
        self.max_elements = max_elements

    def logit_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(f(x, θ*) [B, C], Σ_f [B, C, C] float64)``; None when the closed form does not
        apply and there is a ``fallback``."""
        got = last_layer_glm_covariance(self.model, self.posterior, x, modules=self.modules,
                                        max_elements=self.max_elements)
        if got is None and self.fallback is not None:
            return None
        if got is None:
            raise ValueError(f"layer {self.name!r}: its output is not the model output (or its input is not "
                             "(B, features)); the closed-form last-layer GLM does not apply")
        return got

    def _normals(self, C: int, device) -> torch.Tensor:
        """``z_t ~ N(0, I_C)``, ``t < n_samples``, from ``(seed, t)``: ``[K, C]`` float64."""
        if self._z is None or self._z.shape[1] != C:
            self._z = torch.stack([torch.randn(C, generator=sample_generator(self.seed, t), dtype=F64)
                                   for t in range(self.n_samples)])
        return self._z.to(device)

    def _rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` in row blocks whose ``[b, C, C]`` covariances (and ``[K, b, C]`` logits) stay
        within about ``max_elements`` numbers."""
        C = self.posterior.layers[self.name].shape[0]
        bs = max(1, self.max_elements // max(1, C * max(C, self.n_samples)))
        return list(torch.split(x, bs)) if x.shape[0] > bs else [x]

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Probabilities ``[B, C]`` (model dtype), computed in row blocks (:meth:`_rows`)."""
        parts = self._rows(x)
        if len(parts) > 1:
            return torch.cat([self.predict(p) for p in parts])
        got = self.logit_moments(x)
        if got is None:
            return self.fallback.predict(x)
        f0, cov = got
        f = f0.to(F64)
        if self.link == "probit_pi8":
            p = probit_pi8(f, torch.diagonal(cov, dim1=-2, dim2=-1))
        elif self.link == "probit":
            p = probit_pairwise(f, cov)
        else:
            p = torch.softmax(self._draws(f, cov), dim=-1).mean(0)
        return p.to(f0.dtype)

    def _draws(self, f: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
        """The Gaussian logits ``f + L_f z_t`` ``[K, B, C]``."""
        z = self._normals(f.shape[1], f.device)  # (K, C)
        return f[None] + torch.einsum("bcd,kd->kbc", _factor(cov), z)

    def predict_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(log p̄ [B, C], E_t H(p_t) [B])`` of the ``"mc"`` link, float64 (exact
        log-mean-exp, :func:`laplace_core.predictive.monte_carlo.draw_stats`); None for the probit links."""
        if self.link != "mc":
            return None
        parts = self._rows(x)
        if len(parts) > 1:
            got = [self.predict_stats(p) for p in parts]
            return torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])
        moments = self.logit_moments(x)
        if moments is None:
            fb = self.fallback.predict_batches_stats([x])
            return None if fb is None else fb[0]
        return draw_stats(self._draws(moments[0].to(F64), moments[1]))

    def predict_batches_stats(self, batches: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`predict_stats` per batch; None for the probit links."""
        out = [self.predict_stats(x) for x in batches]
        return None if any(o is None for o in out) else out

    def sample_probs(self, x: torch.Tensor) -> torch.Tensor:
        """``[K, B, C]`` float64: ``softmax(f + L_f z_t)`` per sample (``link="mc"``); their
        mean is :meth:`predict`."""
        if self.link != "mc":
            raise ValueError("per-sample probabilities need link='mc'")
        parts = self._rows(x)
        if len(parts) > 1:
            return torch.cat([self.sample_probs(p) for p in parts], dim=1)
        got = self.logit_moments(x)
        if got is None:
            return self.fallback.sample_probs(x)
        return torch.softmax(self._draws(got[0].to(F64), got[1]), dim=-1)

    def predict_mean_var(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f(x, θ*) [B, C], diag Σ_f [B, C])``."""
        got = self.logit_moments(x)
        if got is None:
            return self.fallback.predict_mean_var(x)
        f0, cov = got
        return f0, torch.diagonal(cov, dim1=-2, dim2=-1).to(f0.dtype)

    def predict_batches(self, batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One ``[B_j, C]`` tensor per batch, equal to :meth:`predict` on that batch."""
        if iter(batches) is batches:
            raise ValueError("predict_batches needs a re-iterable sequence of batches, not a one-shot iterator")
        return [self.predict(x) for x in batches]

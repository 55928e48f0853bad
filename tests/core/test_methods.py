"""The method registry (laplace_core.posteriors.methods) against the structures it names."""
import pytest
import torch

from laplace_core.posteriors.methods import REGISTRY, layer_methods, method_info, needs_basis, needs_efb, order_methods, table3_methods
from laplace_core.posteriors.build import build_posterior
from laplace_core.posteriors.sizes import shape_counts
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics
from laplace_core.posteriors.structures.registry import LAYER_CLASSES


def _stats(efb: bool) -> CurvatureStatistics:
    g = torch.Generator().manual_seed(0)
    m, n, M = 3, 4, 10
    X = torch.randn(M, n, generator=g, dtype=torch.float64)
    E = torch.randn(M, m, generator=g, dtype=torch.float64)
    grads = torch.einsum("bi,bj->bij", E, X)
    ls = LayerStatistics(A=X.T @ X, G=E.T @ E, diag=(grads ** 2).sum(0), efb=None)
    st = CurvatureStatistics(layers={"l": ls}, infos={"l": LayerInfo("l", "linear", m, n, False, (m, n))}, count=M)
    if efb:
        from laplace_core.basis.eigenbasis import eigenbasis

        b = eigenbasis(st)["l"]
        lam = torch.einsum("im,bij,jn->bmn", b.U_G, grads, b.U_A) ** 2
        st = st.with_efb({"l": lam.sum(0)}, M)
    return st


def test_every_per_layer_method_is_a_saved_structure_and_builds_its_own_class():
    assert set(layer_methods()) == set(LAYER_CLASSES)
    st = _stats(efb=True)
    for name in layer_methods():
        post = build_posterior(st, name, rank=2 if name == "inf" else None)
        assert post.method == name and post.layers["l"].method == name


def test_needs_flags_are_what_build_posterior_requires():
    st = _stats(efb=False)
    for name in layer_methods():
        if method_info(name).needs_efb:
            with pytest.raises(ValueError, match="EFB"):
                build_posterior(st, name, rank=2 if name == "inf" else None)
        else:
            build_posterior(st, name)
    assert needs_efb(["diag", "inf"]) and not needs_efb(["diag", "kfac"])
    assert needs_basis(["kfac"]) and not needs_basis(["diag", "subnet"])


def test_table3_methods_are_the_shape_counted_ones_and_order_and_errors():
    assert set(table3_methods()) == set(shape_counts(2, 3))
    assert order_methods(["zz", "inf", "map", "diag", "inf"]) == ["map", "diag", "inf", "zz"]
    with pytest.raises(ValueError, match="valid: " + ", ".join(REGISTRY)):
        method_info("kfc")

"""Lee et al. (2020) Table 1 / Figure 3 reproduction (benchmarks/paper/table1.py), cut to a
few splits: INF's diagonal is exact at full rank and at 5% of the rank, the total errors order
as Lemma 1 / Corollary 1 (KFAC >= EFB >= INF), and EFB's and full-rank INF's off-diagonal
errors are equal; each claim is also checked to be able to fail."""
from __future__ import annotations

import copy

import torch

from benchmarks.paper import table1


def test_table1_claims_hold_per_split(tmp_path):
    res = table1.run(["toy", "diabetes"], splits=2, steps=300)
    assert table1.check(res) == []
    for ds, d in res["datasets"].items():
        for r in d["splits"]:
            e = r["errors"]
            assert e["inf"]["diag"] <= 1e-10 and e["inf5"]["diag"] <= 1e-10
            assert e["kfac"]["diag"] > 1e-3 and e["efb"]["diag"] > 1e-3  # the others are not exact
            assert e["kfac"]["total"] > e["inf"]["total"]  # the ordering is not a tie
            assert e["inf5"]["off"] >= e["inf"]["off"] - 1e-12  # fewer eigenvalues, no better off-diagonal
    bad = copy.deepcopy(res)
    first = bad["datasets"]["toy"]["splits"][0]["errors"]
    first["inf5"]["diag"] = 1e-6
    first["kfac"]["total"] = first["efb"]["total"] / 2
    assert len(table1.check(bad)) == 2
    md = table1.markdown(res)
    assert "all hold" in md and "Lee et al. Table 1" in md


def test_exact_blocks_match_a_dense_jacobian():
    """The reference the errors are measured against: per-example gradients by torch.func equal
    a dense autograd Jacobian of the log-likelihood, layer by layer (vec order ``[W, b]``)."""
    x, y = table1.toy_data(0, n=6)
    model = table1.mlp(1, 3, 0)
    blocks = table1.exact_blocks(model, x, y)
    for name in ("0", "2"):
        lin = model.get_submodule(name)
        rows = []
        for i in range(len(x)):
            model.zero_grad()
            (-0.5 * (model(x[i:i + 1]) - y[i:i + 1]).square().sum()).backward()
            d = torch.cat([lin.weight.grad, lin.bias.grad[:, None]], dim=1)
            rows.append(d.T.reshape(-1))
        V = torch.stack(rows)
        assert torch.allclose(blocks[name], V.T @ V / len(x), rtol=1e-12, atol=1e-12)

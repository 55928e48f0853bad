"""laplace_core.posteriors.sizes against independent counts: per-parameter sums, brute-force INF minima,
and the numbers printed in Lee et al. (2020), Table 3."""
import itertools

import pytest
import torch
from torch import nn

from laplace_core.posteriors import sizes
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3)  # bias: m=4, n=28
        self.c2 = nn.Conv2d(4, 6, (2, 3), bias=False)  # m=6, n=24
        self.bn = nn.BatchNorm2d(6)  # excluded
        self.g = nn.Conv2d(6, 6, 1, groups=2)  # grouped: two 3 x (3 + 1) layers
        self.l1 = nn.Linear(5, 7)  # m=7, n=6
        self.l2 = nn.Linear(7, 3, bias=False)  # m=3, n=7


def independent_counts(model):
    """Count from the parameters themselves, without find_layers."""
    diag = kfac = efb = 0
    for mod in model.modules():
        if type(mod) in (nn.Linear, nn.Conv2d):
            g = getattr(mod, "groups", 1)  # a grouped conv is g independent layers
            m = mod.weight.shape[0] // g
            n = mod.weight.numel() // (m * g) + (mod.bias is not None)
            nparams = sum(p.numel() for p in mod.parameters(recurse=False))
            assert nparams == g * m * n
            diag += nparams
            kfac += g * (m * m + n * n)
            efb += g * (m * m + n * n + m * n)
    return {"diag": diag, "kfac": kfac, "kfac_exact": efb, "efb": efb}


def test_shape_counts_formulas():
    assert sizes.shape_counts(3, 5) == {"diag": 15, "kfac": 34, "kfac_exact": 49, "efb": 49}
    assert sizes.inf_count(3, 5, 2, 4) == 2 * 3 + 4 * 5 + 8 + 15
    with pytest.raises(ValueError):
        sizes.shape_counts(0, 5)
    with pytest.raises(ValueError):
        sizes.inf_count(3, 5, 4, 1)


def test_model_sizes_match_parameter_count():
    model = Toy()
    rep = sizes.model_sizes(model)
    want = independent_counts(model)
    assert {k: v for k, v in rep.totals.items() if k != "inf"} == want
    assert rep.totals["inf"] is None and rep.inf_lower_bound is None
    assert set(rep.excluded) == {"bn"}
    assert [ls.name for ls in rep.layers] == ["c1", "c2", "g.group0", "g.group1", "l1", "l2"]
    assert [(ls.m, ls.n) for ls in rep.layers] == [(4, 28), (6, 24), (3, 4), (3, 4), (7, 6), (3, 7)]


def test_meta_device_model_gives_same_counts():
    with torch.device("meta"):
        meta = Toy()
    assert sizes.model_sizes(meta).totals == sizes.model_sizes(Toy()).totals


def brute_force_inf_min(m, n, k):
    """Minimum INF count over every set of k cells of an m x n grid."""
    best = None
    cells = list(itertools.product(range(m), range(n)))
    for subset in itertools.combinations(cells, k):
        rows = len({i for i, _ in subset})
        cols = len({j for _, j in subset})
        c = rows * m + cols * n + rows * cols + m * n
        best = c if best is None else min(best, c)
    return best


@pytest.mark.parametrize("m,n", [(3, 4), (4, 3), (2, 5), (1, 6)])
def test_inf_lower_bound_is_the_brute_force_minimum(m, n):
    for k in range(1, m * n + 1):
        count, a, b = sizes.inf_lower_bound(m, n, k)
        assert count == brute_force_inf_min(m, n, k), (m, n, k)
        assert a * b >= k and a <= m and b <= n
    # K beyond mn keeps everything
    assert sizes.inf_lower_bound(m, n, m * n + 7)[0] == sizes.inf_count(m, n, m, n)


def topk_rows_cols(lam, k):
    """Independent Algorithm 1 index step: distinct rows/cols of the top-k entries."""
    flat = sorted(((float(v), i, j) for (i, j), v in zip(itertools.product(range(lam.shape[0]), range(lam.shape[1])), lam.flatten())), reverse=True)[:k]
    return torch.tensor(sorted({i for _, i, _ in flat})), torch.tensor(sorted({j for _, _, j in flat}))


def _infos():
    return {
        "a": LayerInfo("a", "linear", 5, 8, True, (5, 7)),
        "b": LayerInfo("b", "conv2d", 6, 12, False, (6, 3, 2, 2)),
    }


def test_inf_exact_from_eigenvalues_and_bound():
    g = torch.Generator().manual_seed(0)
    infos = _infos()
    lam = {k: torch.rand(v.shape, generator=g, dtype=torch.float64) for k, v in infos.items()}
    k = 7
    rep = sizes.count_sizes(infos, rank=k, eigenvalues=lam, sparsify=topk_rows_cols)
    expect = 0
    for name, info in infos.items():
        r, c = topk_rows_cols(lam[name], k)
        m, n = info.shape
        expect += len(r) * m + len(c) * n + len(r) * len(c) + m * n
    assert rep.totals["inf"] == expect
    assert rep.inf_lower_bound <= expect
    # a spectrum concentrated in one column attains the bound |I|=K, |J|=1 when that is optimal
    lam1 = {kk: torch.zeros(v.shape, dtype=torch.float64) for kk, v in infos.items()}
    for kk, v in infos.items():
        _, a, b = sizes.inf_lower_bound(*v.shape, k)
        block = torch.zeros(a, b, dtype=torch.float64)
        block.view(-1)[:k] = torch.arange(k, 0, -1, dtype=torch.float64) + 1.0
        lam1[kk][:a, :b] = block
        lam1[kk] += 1e-3 * torch.rand(v.shape, generator=g, dtype=torch.float64)
    rep1 = sizes.count_sizes(infos, rank=k, eigenvalues=lam1, sparsify=topk_rows_cols)
    assert rep1.totals["inf"] == rep1.inf_lower_bound


def test_real_sparsify_gives_the_same_rows_and_cols():
    sp = pytest.importorskip("laplace_core.posteriors.sparsify")
    g = torch.Generator().manual_seed(1)
    infos = _infos()
    lam = {k: torch.rand(v.shape, generator=g, dtype=torch.float64) for k, v in infos.items()}
    for k in (1, 5, 20):
        ours = sizes.count_sizes(infos, rank=k, eigenvalues=lam, sparsify=topk_rows_cols)
        real = sizes.count_sizes(infos, rank=k, eigenvalues=lam, sparsify=sp.sparsify)
        assert [(l.inf_rows, l.inf_cols) for l in real.layers] == [(l.inf_rows, l.inf_cols) for l in ours.layers]


def test_statistics_sizes_use_efb_over_count():
    g = torch.Generator().manual_seed(2)
    infos = _infos()
    layers = {}
    for k, v in infos.items():
        m, n = v.shape
        layers[k] = LayerStatistics(
            A=torch.eye(n, dtype=torch.float64), G=torch.eye(m, dtype=torch.float64),
            diag=torch.ones(m, n, dtype=torch.float64), efb=torch.rand(m, n, generator=g, dtype=torch.float64) * 10,
        )
    stats = CurvatureStatistics(layers=layers, infos=infos, count=10, efb_count=10, excluded={"bn": "x"})
    seen = {}

    def spy(lam, k):
        seen[len(seen)] = lam.clone()
        return topk_rows_cols(lam, k)

    rep = sizes.statistics_sizes(stats, rank=4, sparsify=spy)
    assert rep.inf_from_statistics and rep.totals["inf"] is not None
    torch.testing.assert_close(seen[0], layers["a"].efb / 10, rtol=0, atol=0)
    assert rep.excluded == {"bn": "x"}
    # no rank -> no INF count, no sparsify call
    assert sizes.statistics_sizes(stats).totals["inf"] is None


def test_bad_input_raises():
    infos = _infos()
    with pytest.raises(ValueError, match="rank"):
        sizes.count_sizes(infos, rank=0)
    with pytest.raises(ValueError, match="rank"):
        sizes.count_sizes(infos, eigenvalues={k: torch.ones(v.shape) for k, v in infos.items()})
    with pytest.raises(ValueError, match="shape"):
        sizes.count_sizes(infos, rank=3, eigenvalues={k: torch.ones(2, 2) for k in infos}, sparsify=topk_rows_cols)
    with pytest.raises(ValueError, match="missing"):
        sizes.count_sizes(infos, rank=3, eigenvalues={}, sparsify=topk_rows_cols)


# Lee et al. (2020), Table 3: (Diag, KFAC, EFB, INF at rank 100) numbers and MB.
PAPER_TABLE3 = {
    "resnet18": (11_679_912, 95_013_546, 106_693_458, 12_317_373, (44.6, 362.4, 407.0)),
    "resnet50": (25_503_912, 153_851_562, 179_355_474, 27_614_896, (97.3, 586.9, 684.2)),
    "densenet121": (7_895_208, 103_094_954, 110_990_162, 9_711_081, (30.1, 393.3, 423.4)),
}


@pytest.mark.parametrize("name", sorted(PAPER_TABLE3))
def test_reproduces_paper_table3(name):
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.get_model(name, weights=None)
    rep = sizes.model_sizes(model, rank=100, name=name)
    diag, kfac, efb, inf, mbs = PAPER_TABLE3[name]
    t = rep.totals
    assert (t["diag"], t["kfac"], t["efb"]) == (diag, kfac, efb)
    assert [round(sizes.to_mb(x), 1) for x in (diag, kfac, efb)] == list(mbs)
    assert independent_counts(model)["diag"] == diag
    # the paper's INF count (data-dependent I, J) respects our shape-only lower bound
    assert diag < rep.inf_lower_bound <= inf


def test_format_table_labels_the_bound():
    rep = sizes.count_sizes(_infos(), rank=3)
    text = sizes.format_table(rep)
    assert "lower bound" in text and ">=" in text
    js = rep.to_json()
    assert js["methods"]["inf"]["numbers"] is None
    assert js["methods"]["inf"]["lower_bound"] == rep.inf_lower_bound
    assert js["methods"]["diag"]["numbers"] == 5 * 8 + 6 * 12

"""(INF draw, rank ~100) / (KFAC draw) on torchvision resnet18's layer shapes, CPU, float32.

The cost of a draw depends only on the shapes: KFAC's matrix-normal draw is two factor
products per layer (``m^2 n + m n^2``); INF's Woodbury draw (Lee et al. eq. 6, with the vec
trick) is elementwise in ``m x n`` plus products with the kept ``m x |I|`` and ``n x |J|``
eigenvectors. Factors are random orthogonal matrices; ``|I| = |J| = 10`` (top-100 of a
Kronecker spectrum keeps about 10 rows and 10 columns). Run:
``python benchmarks/sampling.py``; ``benchmarks/core_pass.py`` measures the same ratio on
posteriors fitted to data (slower: it needs the float64 eigendecompositions).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import time, statistics, torch, torchvision
from laplace_core.curvature.layers import find_layers
from laplace_core.posteriors.structures.kron import KronLayer
from laplace_core.posteriors.structures.inf import InfLayer
torch.manual_seed(0)
with torch.device("meta"):
    model = torchvision.models.resnet18()
_, infos, _ = find_layers(model)
dt = torch.float32
kron, inf = [], []
for name, info in infos.items():
    m, n = info.shape
    QA = torch.linalg.qr(torch.randn(n, n))[0]; QG = torch.linalg.qr(torch.randn(m, m))[0]
    kron.append(KronLayer(QA, torch.rand(n), QG, torch.rand(m), 1000.0, 1.0))
    nI, nJ = min(m, 10), min(n, 10)   # top-100 of a Kronecker spectrum keeps ~10 rows x 10 cols
    inf.append(InfLayer(QG[:, :nI].contiguous(), QA[:, :nJ].contiguous(), torch.rand(nI, nJ), torch.rand(m, n), 1000.0, 1.0))
def draw(layers):
    for lp in layers:
        lp.scale_matvec(torch.randn(lp.shape))
for f in (lambda: draw(kron), lambda: draw(inf)): f()
tk, ti = [], []
for _ in range(5):
    t0 = time.perf_counter(); draw(kron); tk.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); draw(inf); ti.append(time.perf_counter() - t0)
k, i = statistics.median(tk), statistics.median(ti)
print(f"resnet18 one draw of all layers: KFAC {k*1e3:.0f} ms, INF(rank~100, L=100/layer) {i*1e3:.0f} ms, ratio INF/KFAC = {i/k:.3f}")

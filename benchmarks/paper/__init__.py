"""Reproductions of Lee et al. (2020)'s own results with the shipped code (see docs/paper-results.md): Table 1 / Figure 3, Figure 4 and Table 2."""

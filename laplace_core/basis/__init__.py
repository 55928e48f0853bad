"""Floor 2 of ``laplace_core``: curvature statistics -> the eigenbasis of the Kronecker
factors (:mod:`.eigenbasis`), which the EFB pass of :mod:`laplace_core.curvature` and the
posteriors of :mod:`laplace_core.posteriors` (efb, kfac_exact, inf) read."""

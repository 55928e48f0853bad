"""Search and evaluation on Ray actors, in data-flow order: ``chunks`` (fixed-size batches),
``predictors`` (model, posteriors, predictive), ``runtime`` (the stages' settings from the
run config), ``actors`` (the one actor engine), ``search`` ((N, τ) random search),
``evaluate`` (MC evaluation of MAP and every posterior)."""

"""The prediction: a NeoX config's operators, priced by a cluster profile, corrected, laid on
the 1F1B timeline. One module per step, in the order data flows through them:

    opspec        what each operator computes and moves (FLOPs, bytes) and the features its
                  profile model is keyed by
    operators     the decomposition: a config's calls per stage, layer and micro-batch
                  (Decomposition, StageWork, OpCall, CommCall)
    network       the links a cluster description names (bandwidths the link model prices)
    estimate      each call priced once per distinct shape, the corrections below applied,
                  stage times, the timeline, the breakdown (IterationEstimate)
    timeline      1F1B with data-parallel overlap (arXiv 2509.22832, Eq. 7)
    predict       the one pipeline the commands call: config -> decomposition -> estimate

    corrections   what the priced calls miss, each correction naming what it corrects and
                  applying only there, in one documented order (corrections/__init__.py):
                  step terms, engine terms, the interval per regime
    collective_sources  where each collective's price came from (sampled, link model, engine)

Nothing here imports torch, deepspeed or rich: `check` runs on this path.
"""

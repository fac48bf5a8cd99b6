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

The corrections, each naming what it corrects, applied in this order (estimate._Cache and
estimate._stage_times):

    1. a transferred GPU or another precision (predictors.achievable.OperatorLimits.rescaled):
       an operator sampled on one GPU or dtype, priced on the run's;
    2. the step terms' operator scales (step_terms.StepTerms.operator): what isolated
       operator timings miss inside a real step -- compute- and memory-bound slowdowns;
    3. the achievable-rate cap (OperatorLimits.capped): no operator faster than its GPU can go;
    4. host issue (StepTerms.issued): a layer's operators queue behind the host's launches;
    5. collectives by where their price came from (collective_sources): the engine's own runs
       (engine_terms.EngineTerms.tp_allreduce / dp_collective) where a calibration measured
       them, else the profile's samples or its description's link model, then
       StepTerms.collective: a tensor-parallel barrier per all-reduce, a pipeline handshake
       per send, and the data-parallel fabric term, which rides on link-model prices only,
       never on sampled ones, and stops growing past the widest group it was fitted on;
    6. the engine's residuals (engine_terms.EngineTerms: layer, head and loss, gradient
       accumulation, the optimizer step, the gradient reduction), measured by `calibrate`
       under DeepSpeed on the machine itself;
    7. per micro-batch and per step (StepTerms.per_micro_batch, step_s): the engine's own
       bookkeeping where the step terms measured it.

Nothing here imports torch, deepspeed or rich: `check` runs on this path.
"""

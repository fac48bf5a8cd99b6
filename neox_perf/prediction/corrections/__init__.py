"""The corrections: what the priced operators and collectives miss, each naming what it
corrects and applying only there, in one order (estimate._Cache and estimate._stage_times
apply them; Corrections carries one profile's, read once per estimate):

    1. a transferred GPU or another precision (predictors.achievable.OperatorLimits.rescaled):
       an operator sampled on one GPU or dtype, priced on the run's;
    2. the step terms' operator scales (step.StepTerms.operator): what isolated operator
       timings miss inside a real step -- compute- and memory-bound slowdowns;
    3. the achievable-rate cap (OperatorLimits.capped): no operator faster than its GPU can go;
    4. host issue (StepTerms.issued): a phase's operators queue behind the host's launches;
    5. collectives, by where their price came from (..collective_sources): the engine's own
       runs (Corrections.measured_collective) where a calibration measured them, taking no
       step term; else the profile's samples or its description's link model, then
       StepTerms.collective: a pipeline handshake per send, and the data-parallel fabric
       term, which rides on link-model prices only, never on sampled ones, and stops growing
       past the widest group it was fitted on;
    6. the engine's residuals (engine.EngineTerms: layer, head and loss, tensor-parallel
       phases, gradient accumulation, the optimizer step, the gradient reduction), measured by
       `calibrate` under DeepSpeed on the machine itself;
    7. per micro-batch and per step (StepTerms.per_micro_batch, step_s): the engine's own
       bookkeeping where the step terms measured it;
    8. the interval (interval.Intervals, per regime), widened where the terms were measured
       on another GPU (of_profile) and where a prediction extrapolates, and reaching what the
       step terms the fitting runs could not see say at either end of their range
       (unseen.py; estimate.span_unseen).

Modules: step (StepTerms, fitted on measured end-to-end runs), engine (EngineSection /
EngineTerms, fitted by `calibrate`), interval (Interval, Intervals, the regimes), section (the
manifest's "step_terms" section), of_profile (what a profile carries: Corrections, of_profile),
unseen (the terms a fit's runs could not see: their ends and the interval's spread).
"""
from .engine import EngineSection, EngineTerms, EngineTermsError
from .interval import (ACROSS_NODES, INSIDE_NODE, ONE_NIC_PER_GPU, ONE_NIC_UPWARD, REGIMES,
                       Interval, Intervals, regime_of)
from .of_profile import VALIDATION_MIN_RUNS, Corrections, of_profile, unseen_of
from .section import REFIT, StepTermsSection
from . import unseen
from .step import COMPUTE_BOUND, DATA_PARALLEL, FABRIC_NODES_FITTED, FITTED, StepTerms, fabric_nodes

__all__ = ["ACROSS_NODES", "COMPUTE_BOUND", "Corrections", "DATA_PARALLEL", "EngineSection",
           "EngineTerms", "EngineTermsError", "FABRIC_NODES_FITTED", "FITTED", "INSIDE_NODE",
           "Interval", "Intervals", "ONE_NIC_PER_GPU", "ONE_NIC_UPWARD", "REFIT", "REGIMES",
           "StepTerms", "StepTermsSection", "VALIDATION_MIN_RUNS", "fabric_nodes", "of_profile",
           "regime_of", "unseen", "unseen_of"]

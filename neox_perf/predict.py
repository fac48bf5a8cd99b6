"""The one prediction pipeline: derived model -> per-stage operators -> timed 1F1B iteration.

`check`, `validate`, `plan` and the run hook all predict through `predict()`, so a change to
how stages are shaped or timed reaches every command at once. Loading a cluster (a profile
name, a profile directory or a cluster description file) happens once, in `load_cluster`,
whose failures are one line naming the cluster and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from .errors import UsageError
from .estimate import IterationEstimate, estimate
from .operators import Decomposition, StageShape, decompose


@dataclass(frozen=True)
class Prediction:
    decomposition: Decomposition  # what each stage runs, untimed
    estimate: IterationEstimate  # the timed iteration

    @property
    def iteration_seconds(self) -> float:
        return self.estimate.iteration_seconds


def stage_shapes(derived, transformer_layers: Optional[Sequence[int]] = None) -> List[StageShape]:
    """The decomposition's view of each pipeline stage. ``transformer_layers`` overrides the
    derived count per stage, for a run whose engine partitioned the layers differently."""
    stages = derived.stages
    if transformer_layers is not None and len(transformer_layers) != len(stages):
        raise ValueError(f"{len(transformer_layers)} layer counts for {len(stages)} stages")
    last = len(stages) - 1
    return [StageShape(index=s.index,
                       transformer_layers=(transformer_layers[s.index] if transformer_layers is not None
                                           else s.transformer_layers),
                       has_embedding=s.index == 0, has_head=s.index == last,
                       params_per_rank=s.params_per_rank) for s in stages]


def predict(cfg, derived, profile, *, precision: Optional[str] = None,
            transformer_layers: Optional[Sequence[int]] = None) -> Prediction:
    """Time one training iteration of ``cfg`` (already derived) on ``profile``'s cluster.

    precision: what the run really computes in when that differs from the config (the
    reference workload runs fp32 on a CPU); default the config's.
    """
    decomp = decompose(cfg, derived.padded_vocab, stage_shapes(derived, transformer_layers),
                       precision=precision)
    return Prediction(decomp, estimate(decomp, profile))


def load_cluster(name: Optional[str]):
    """A cluster profile by bundled/user name, profile directory or description file; None for
    None. Every failure is one UsageError line naming the cluster and the fix."""
    if name is None:
        return None
    from .predictors.profile import load_profile
    try:
        return load_profile(name)
    except Exception as exc:  # the profile layer raises one-line errors of its own
        line = getattr(exc, "line", None)
        raise UsageError(line() if callable(line) else str(exc)) from None

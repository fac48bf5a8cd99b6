"""Errors raised when NeoX or DeepSpeed would refuse to build what the config describes."""
from __future__ import annotations

from ..errors import NeoxPerfError


class DeriveError(NeoxPerfError, ValueError):
    """NeoX would stop while building the model (a shape that does not divide, an unknown option).

    A ValueError too, so callers that only know the standard library can still catch it.
    """

    def __init__(self, message: str):
        # The CLI prints errors as one line; multi-line messages would break that contract.
        super().__init__(" ".join(str(message).split()))


class PartitionError(DeriveError):
    """DeepSpeed's PipelineModule would refuse (or build an unusable) pipeline partition."""

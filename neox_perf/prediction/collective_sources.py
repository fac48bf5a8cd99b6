"""Where a collective's price comes from, named once for every layer that reads it.

A collective priced from samples measured on this cluster's own links carries the fabric's loss
under load; one priced by a description's link model (line rate x a reference efficiency) does
not; one the engine terms measured in a calibration's own engine runs is that machine's. A
correction fitted against one source rides on that source's prices alone
(corrections.StepTerms.collective); `check --json` shows each (prediction.collective_sources).
"""
SAMPLED, LINK_MODEL, ENGINE_RUNS = "sampled", "link model", "engine runs"
COLLECTIVE_SOURCES = (SAMPLED, LINK_MODEL, ENGINE_RUNS)

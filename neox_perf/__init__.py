"""neox-perf: what a GPT-NeoX config builds, whether it fits, and how long it trains."""

__version__ = "0.1.0"

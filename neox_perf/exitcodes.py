"""Exit codes of the neox-perf CLI; job scripts branch on these, so they never change meaning."""

OK = 0
INVALID_CONFIG = 1  # the config is something NeoX/DeepSpeed would refuse, or unreadable
USAGE = 2  # the command line is wrong
VERDICT_FAILED = 3  # the config is valid but a check failed (out of memory, too slow, ...)
INTERNAL = 4  # a bug in neox-perf itself; reported as one line, the traceback with --debug

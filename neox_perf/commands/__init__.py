"""One module per CLI command; each returns a result object and prints nothing."""

"""Measuring the user's own hardware: operator and collective benchmarks, reference workload, validation."""

"""Reference NeoX-shaped training workload, run under the real DeepSpeed engine.

GPT-NeoX itself needs CUDA kernels and is not on PyPI; this package rebuilds its
GPT2ModelPipe with the same operators, shapes, layer names and collectives so that
neox-perf's predictions can be checked against real DeepSpeed runs, on CPU (gloo) or GPU
(nccl). Entry point: ``python -m neox_perf.calibration.workload.train`` (see train.py).
"""

"""What causal flash attention costs here against non-causal, and what a profile predicts for it.

Times `flash_attention` (F.scaled_dot_product_attention, the calibration's own case) with
causal 0 and 1 at a few NeoX-shaped sizes, forward and backward, and prints the measured
causal / non-causal ratio beside the two kernels' work fractions (opspec.causal_work_fraction:
FlashAttention-2's 128-row tiles, and PyTorch's CPU kernel's blocks, which a CPU profile's
baseline prices causal calls with) and, with --cluster (repeatable), each profile's prediction
of the causal call over its measured time. A CPU kernel's blocks are not a GPU's tiles, which
is why local profiles sample causal 1 themselves.

    python benchmarks/causal_flash.py [--cluster NAME ...]
"""
from __future__ import annotations

import argparse

SHAPES = ((1, 4096, 4, 64), (1, 3072, 4, 64), (1, 2048, 2, 64), (1, 1024, 4, 64), (1, 768, 8, 64),
          (2, 384, 6, 64), (1, 384, 10, 64), (2, 256, 6, 64), (4, 128, 12, 64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", action="append", default=[],
                    help="a profile whose predictions to print beside (repeatable)")
    args = ap.parse_args(argv)

    from neox_perf.calibration.bench import Protocol, Timer, measure
    from neox_perf.calibration.launch import use_caching_malloc
    from neox_perf.calibration.sweep import pick_threads, pinned_threads
    from neox_perf.prediction.opspec import TORCH_CPU, causal_work_fraction
    from neox_perf.prediction.predict import load_cluster

    profiles = [(name, load_cluster(name)) for name in args.cluster]
    use_caching_malloc()
    timer, protocol = Timer(), Protocol(warmup=1, repeats=5)
    print("b l heads head_dim phase: non-causal ms, causal ms, causal/non-causal "
          "(FlashAttention-2's tiles, the CPU kernel's blocks)"
          + "".join(f"; {name}: predicted / measured causal" for name, _ in profiles))
    with pinned_threads(pick_threads(None, "cpu")):
        for b, l, heads, hd in SHAPES:
            for phase in ("fwd", "bwd"):
                ms = []
                for causal in (0, 1):
                    f = {"b": b, "l": l, "heads": heads, "head_dim": hd, "causal": causal}
                    ms.append(1e3 * measure("flash_attention", phase, f, timer=timer,
                                            protocol=protocol).aggregate.median)
                line = (f"{b} {l} {heads} {hd} {phase}: {ms[0]:.2f}, {ms[1]:.2f}, "
                        f"{ms[1] / ms[0]:.3f} ({float(causal_work_fraction(l)):.3f}, "
                        f"{float(causal_work_fraction(l, TORCH_CPU)):.3f})")
                f = {"b": b, "l": l, "heads": heads, "head_dim": hd, "causal": 1}
                for _, profile in profiles:
                    line += f"; {1e3 * profile.predict('flash_attention', phase, f).seconds / ms[1]:.3f}"
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

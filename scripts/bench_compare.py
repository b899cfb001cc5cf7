"""How often eval/compare.py calls two equally fast drafters different (docs/benchmarks/loop.md, the intervals' calibration).

    python scripts/bench_compare.py                    # 8, 20 and 48 prompts, 400 simulated measurements each

Each simulated measurement times two drafters that are equally fast: every prompt takes its own
length of time (uniform in 0.5-2 s), the same for both, times independent log-normal timing noise
(sigma 0.15) per run, over 3 repeats. A 95 % interval should exclude 1, calling them different, in
about 5 % of measurements. Printed for the interval `compare` reports and for the plain percentile
interval it widens (eval/compare.py says how and why).
"""

from __future__ import annotations

import argparse

import numpy as np

from eval.compare import Timings, compare


def false_difference_rate(prompts: int, trials: int, *, noise: float = 0.15, repeats: int = 3, seed: int = 1,
                          resamples: int = 1000, widen: bool = True) -> float:
    """Share of `trials` simulated measurements of two equally fast drafters not judged "tied"."""
    rng = np.random.default_rng(seed)
    wrong = 0
    for _ in range(trials):
        length = rng.uniform(0.5, 2.0, size=prompts)
        a, b = (Timings(np.full((repeats, prompts), 64.0), length * rng.lognormal(0.0, noise, size=(repeats, prompts)))
                for _ in range(2))
        wrong += compare(a, b, ["c"] * prompts, resamples=resamples, widen=widen).verdict != "tied"
    return wrong / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="8,20,48", help="prompts per measurement, comma-separated")
    ap.add_argument("--trials", type=int, default=400)
    args = ap.parse_args()
    print(f"share of {args.trials} measurements of two equally fast drafters whose 95 % interval excludes 1:")
    for n in (int(x) for x in args.prompts.split(",")):
        print(f"{n:>4} prompts: reported interval {false_difference_rate(n, args.trials):.3f}, "
              f"plain percentile interval {false_difference_rate(n, args.trials, widen=False):.3f}")


if __name__ == "__main__":
    main()

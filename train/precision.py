"""The training precision: `trainer.precision=auto` is bf16 where the hardware multiplies bf16 natively."""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_multiplies_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), where bf16 matrix products run
    faster than float32 (docs/benchmarks/smollm2-training.md, bf16 on a CPU); without them bf16 is emulated."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def mixed_precision(precision: str, on_cpu: bool) -> str:
    """trainer.precision as Accelerate takes it: `auto` is bf16 where the hardware multiplies bf16 natively,
    else no (float32)."""
    if precision not in ("no", "bf16", "fp16", "auto"):
        raise ValueError(f"trainer.precision must be no, bf16, fp16 or auto, got {precision!r}")
    if precision != "auto":
        return precision
    if on_cpu:
        return "bf16" if cpu_multiplies_bf16() else "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "no"

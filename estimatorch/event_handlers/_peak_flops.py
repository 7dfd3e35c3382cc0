"""The peak FLOP/s of the accelerators SpeedMonitor knows, the denominator of MFU.

Dense (no 2:4 sparsity) tensor-core figures from NVIDIA's datasheets, per GPU, in FLOP/s, by the
precision of the matrix multiplications: ``"fp32"`` (CUDA cores), ``"tf32"`` (float32 matmuls
allowed to use TF32), ``"bf16"`` and ``"fp16"``. A device or precision not listed has no peak:
pass ``SpeedMonitor(peak_flops=...)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["PEAK_FLOPS", "matmul_precision", "peak_flops"]

_T = 1e12

#: ``(name fragment, {precision: FLOP/s})``, matched in order against ``torch.cuda.get_device_name``
#: (the first fragment the name contains wins: "H100 NVL" before "H100", "A100" before "A10",
#: "L40" before "L4").
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T}),
    ("H200", {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T}),  # SXM
    ("H100 NVL", {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T}),
    ("H100 PCIe", {"fp32": 51.2 * _T, "tf32": 378 * _T, "bf16": 756.5 * _T, "fp16": 756.5 * _T}),
    ("H100", {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T}),  # SXM (HBM3)
    ("A100", {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T}),  # SXM and PCIe
    ("L40S", {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T}),
    ("L40", {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181 * _T, "fp16": 181 * _T}),
    ("L4", {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T}),
    ("A10G", {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T}),  # the A10's figures
    ("A10", {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T}),
    ("V100", {"fp32": 15.7 * _T, "fp16": 125 * _T}),  # SXM2; no bf16 tensor cores
    ("T4", {"fp32": 8.1 * _T, "fp16": 65 * _T}),
)


def matmul_precision(precision: str, net: Any) -> str:
    """The precision of a step's matrix multiplications: ``"bf16"`` / ``"fp16"`` under mixed
    precision or for a net whose parameters are in that dtype, else ``"tf32"`` when float32
    matmuls may use TF32 on CUDA (``torch.backends.cuda.matmul.allow_tf32``, or a float32
    matmul precision other than ``"highest"``), else ``"fp32"``.

    Example:
        >>> matmul_precision("bf16-mixed", torch.nn.Linear(2, 2)), matmul_precision("16-mixed", None)
        ('bf16', 'fp16')
        >>> matmul_precision("32", torch.nn.Linear(2, 2).to(torch.bfloat16))
        'bf16'
    """
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), None) if net is not None else None
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype is torch.bfloat16 else "fp16"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def peak_flops(device_name: str, precision: str) -> Optional[float]:
    """The table's peak FLOP/s for ``device_name`` at ``precision``, None when it has none.

    Example:
        >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16") / 1e12, peak_flops("NVIDIA H100 PCIe", "tf32") / 1e12
        (989.4, 378.0)
        >>> peak_flops("NVIDIA A100-SXM4-80GB", "fp32") / 1e12, peak_flops("NVIDIA A10G", "bf16") / 1e12
        (19.5, 125.0)
        >>> peak_flops("Tesla V100-SXM2-16GB", "bf16"), peak_flops("AMD Instinct MI300X", "bf16")
        (None, None)
    """
    for fragment, peaks in PEAK_FLOPS:
        if fragment in device_name:
            return peaks.get(precision)
    return None

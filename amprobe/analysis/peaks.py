"""Peak dense math throughput of common GPUs, per precision, as data (for MFU).

Figures are NVIDIA's published peaks in TFLOP/s (TOPS for int8) **without** structured
sparsity: where a datasheet quotes only the sparse figure, it is halved. For GeForce cards the
half-precision figures are those with FP32 accumulation, which is what PyTorch's matmuls use.
TF32 and FP8 are absent where the architecture has none. Each entry names its source.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

__all__ = ["DevicePeak", "PEAKS", "lookup_peak", "precision_of"]

_DATASHEETS = {
    "V100": "NVIDIA V100 Tensor Core GPU datasheet, https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
    "T4": "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
    "A10": "NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf",
    "A100": "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "L4": "NVIDIA L4 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
    "L40S": "NVIDIA L40S GPU datasheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413",
    "GA102": "NVIDIA Ampere GA102 GPU Architecture whitepaper (tables 9-10), https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf",
    "AD102": "NVIDIA Ada GPU Architecture whitepaper (appendix A), https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    "H100": "NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
    "H200": "NVIDIA H200 Tensor Core GPU product page and datasheet, https://www.nvidia.com/en-us/data-center/h200/",
}


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Peak dense throughput of one device.

    Attributes:
        name: the product, as NVIDIA names it.
        pattern: regular expression matched (case-insensitive) against the CUDA device name.
        tflops: precision (``fp32``, ``tf32``, ``fp16``, ``bf16``, ``fp8``, ``int8``) -> TFLOP/s.
        source: where the figures come from.
    """

    name: str
    pattern: str
    tflops: Mapping[str, float]
    source: str


def _peak(name: str, pattern: str, source: str, **tflops: float) -> DevicePeak:
    return DevicePeak(name, pattern, dict(tflops), _DATASHEETS[source])


#: Ordered: the first pattern that matches wins, so specific variants come before families.
PEAKS: tuple[DevicePeak, ...] = (
    _peak(
        "H200 NVL",
        r"H200.*NVL",
        "H200",
        fp32=60,
        tf32=417.5,
        fp16=835.5,
        bf16=835.5,
        fp8=1670.5,
        int8=1670.5,
    ),
    _peak(
        "H200 SXM",
        r"H200",
        "H200",
        fp32=67,
        tf32=494.5,
        fp16=989.5,
        bf16=989.5,
        fp8=1979,
        int8=1979,
    ),
    _peak(
        "H100 NVL",
        r"H100.*NVL",
        "H100",
        fp32=60,
        tf32=417.5,
        fp16=835.5,
        bf16=835.5,
        fp8=1670.5,
        int8=1670.5,
    ),
    _peak(
        "H100 PCIe",
        r"H100.*PCIe",
        "H100",
        fp32=51,
        tf32=378,
        fp16=756,
        bf16=756,
        fp8=1513,
        int8=1513,
    ),
    _peak(
        "H100 SXM",
        r"H100",
        "H100",
        fp32=67,
        tf32=494.5,
        fp16=989.5,
        bf16=989.5,
        fp8=1979,
        int8=1979,
    ),
    _peak("A100", r"A100", "A100", fp32=19.5, tf32=156, fp16=312, bf16=312, int8=624),
    _peak("A10", r"\bA10\b", "A10", fp32=31.2, tf32=62.5, fp16=125, bf16=125, int8=250),
    _peak("L40S", r"L40S", "L40S", fp32=91.6, tf32=183, fp16=362, bf16=362, fp8=733, int8=733),
    _peak("L4", r"\bL4\b", "L4", fp32=30.3, tf32=60, fp16=121, bf16=121, fp8=242.5, int8=242.5),
    _peak("V100 PCIe", r"V100.*PCIE", "V100", fp32=14, fp16=112),
    _peak("V100 SXM2", r"V100", "V100", fp32=15.7, fp16=125),
    _peak("T4", r"\bT4\b", "T4", fp32=8.1, fp16=65, int8=130),
    _peak(
        "GeForce RTX 3090 Ti", r"RTX 3090 Ti", "GA102", fp32=40, tf32=40, fp16=80, bf16=80, int8=320
    ),
    _peak(
        "GeForce RTX 3090", r"RTX 3090", "GA102", fp32=35.6, tf32=35.6, fp16=71, bf16=71, int8=284
    ),
    _peak(
        "GeForce RTX 3080",
        r"RTX 3080",
        "GA102",
        fp32=29.8,
        tf32=29.8,
        fp16=59.5,
        bf16=59.5,
        int8=238,
    ),
    _peak(
        "GeForce RTX 4090",
        r"RTX 4090",
        "AD102",
        fp32=82.6,
        tf32=82.6,
        fp16=165.2,
        bf16=165.2,
        fp8=330.3,
        int8=660.6,
    ),
    _peak(
        "GeForce RTX 4080",
        r"RTX 4080",
        "AD102",
        fp32=48.7,
        tf32=48.7,
        fp16=97.5,
        bf16=97.5,
        fp8=194.9,
        int8=389.9,
    ),
)


def lookup_peak(device_name: str | None) -> DevicePeak | None:
    """The peak entry for a CUDA device name (e.g. ``NVIDIA H100 80GB HBM3``), or None."""
    if not device_name:
        return None
    for entry in PEAKS:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            return entry
    return None


def precision_of(dtype: str | None, tf32: bool = False) -> str | None:
    """The peak-table precision a matmul operand dtype runs at (fp32 -> tf32 when allowed)."""
    if dtype is None:
        return None
    if dtype == "float32":
        return "tf32" if tf32 else "fp32"
    if dtype == "float16":
        return "fp16"
    if dtype == "bfloat16":
        return "bf16"
    if dtype.startswith("float8"):
        return "fp8"
    if dtype in ("int8", "uint8"):
        return "int8"
    return None

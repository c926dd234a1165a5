"""Where a finding points the user: its checklist item and the PyTorch / NVIDIA documentation.

Every finding's first ref is its checklist item, e.g. ``NaN checklist #9 (AMP-N09): unscale_
before clipping`` (the numbering of ``docs``' checklist: the NaN, speed, distributed and
what-if sections number their items from 1). Rules add the documents that explain the fix.
"""

from __future__ import annotations

__all__ = [
    "AMP_DOCS",
    "AMP_EXAMPLES",
    "GRADIENT_SCALING",
    "AUTOCAST_OPS",
    "CLIPPING_EXAMPLE",
    "CHECKPOINT_EXAMPLE",
    "TYPICAL_EXAMPLE",
    "MULTI_GPU_EXAMPLE",
    "DATA_LOADING",
    "TUNING_GUIDE",
    "FP8_PRIMER",
    "MATMUL_GUIDE",
    "FC_GUIDE",
    "MX_SPEC",
    "BLOCK_SCALING",
    "CHECKLIST_TITLES",
    "checklist_ref",
]

AMP_DOCS = "https://pytorch.org/docs/stable/amp.html"
AMP_EXAMPLES = "https://pytorch.org/docs/stable/notes/amp_examples.html"
GRADIENT_SCALING = AMP_DOCS + "#gradient-scaling"
AUTOCAST_OPS = AMP_DOCS + "#autocast-op-reference"
TYPICAL_EXAMPLE = AMP_EXAMPLES + "#typical-mixed-precision-training"
CLIPPING_EXAMPLE = AMP_EXAMPLES + "#gradient-clipping"
CHECKPOINT_EXAMPLE = AMP_EXAMPLES + "#saving-resuming"
MULTI_GPU_EXAMPLE = AMP_EXAMPLES + "#working-with-multiple-gpus"
DATA_LOADING = "https://pytorch.org/docs/stable/data.html#multi-process-data-loading"
TUNING_GUIDE = "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html"
FP8_PRIMER = (
    "Transformer Engine, Using FP8 (formats, per-tensor scaling recipes): "
    "https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/examples/fp8_primer.html"
)
MATMUL_GUIDE = (
    "NVIDIA Matrix Multiplication Background User's Guide, Tensor Core Requirements: "
    "https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html"
)
FC_GUIDE = (
    "NVIDIA Linear/Fully-Connected Layers User's Guide: "
    "https://docs.nvidia.com/deeplearning/performance/dl-performance-fully-connected/index.html"
)
MX_SPEC = (
    "OCP Microscaling Formats (MX) Specification v1.0 (MXFP8, MXFP4: 32-element blocks, e8m0 "
    "scales): https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf"
)
BLOCK_SCALING = (
    "NVIDIA, Pretraining Large Language Models with NVFP4 (16-element blocks, e4m3 scales, "
    "layers kept in higher precision): https://arxiv.org/abs/2509.25149"
)
COMPILE_RECOMPILES = (
    "torch.compile programming model, recompilation: "
    "https://docs.pytorch.org/docs/main/user_guide/torch_compiler/compile/"
    "programming_model.recompilation.html"
)
COMPILE_GRAPH_BREAKS = (
    "torch.compile programming model, graph breaks: "
    "https://docs.pytorch.org/docs/main/user_guide/torch_compiler/compile/"
    "programming_model.graph_breaks_index.html"
)

_SECTIONS = {
    "N": "NaN checklist",
    "S": "Speed checklist",
    "D": "Distributed checklist",
    "P": "Precision what-if checklist",
}

#: checklist ID -> the item's title, as the user reads it next to the finding.
CHECKLIST_TITLES: dict[str, str] = {
    "AMP-N01": "read the loss-scale history first",
    "AMP-N02": "skipped steps lower the effective learning rate",
    "AMP-N03": "a collapsing scale means a forward op overflows",
    "AMP-N04": "non-finite input batches are a data problem",
    "AMP-N05": "pin the first overflowing op to fp32",
    "AMP-N06": "gradients underflowing in fp16",
    "AMP-N07": "a scale stuck low means persistently large gradients",
    "AMP-N08": "create the GradScaler once, outside the loop",
    "AMP-N09": "unscale_ before clipping",
    "AMP-N10": "save and restore the scaler state",
    "AMP-N11": "prefer bf16 where the hardware supports it",
    "AMP-N12": "fp16 needs a GradScaler",
    "AMP-N13": "compute the loss in fp32",
    "AMP-N14": "keep fp32 master weights",
    "AMP-N15": "bf16 needs no loss scaling",
    "AMP-N16": "keep embedding, output and normalization layers in fp32",
    "AMP-N17": "replay the first bad step to measure its cause",
    "AMP-N18": "never overwrite the last good checkpoint with a poisoned one",
    "AMP-S01": "feed the device faster",
    "AMP-S02": "a thin model gains memory, not speed",
    "AMP-S03": "keep host-device syncs out of the hot loop",
    "AMP-S04": "pad matmul dimensions to Tensor Core multiples",
    "AMP-S05": "run forward and loss inside autocast",
    "AMP-S06": "AMP slower than expected against FP32",
    "AMP-S07": "Tensor Cores idle under AMP",
    "AMP-S08": "a compiled model must not keep recompiling",
    "AMP-D01": "ranks must agree on the loss scale",
    "AMP-D02": "the slowest rank sets the pace",
    "AMP-D03": "reduce gradients in fp32",
    "AMP-D04": "find the rank a non-finite value came from",
    "AMP-D05": "data-parallel replicas must hold identical weights",
    "AMP-D06": "drain a device that computes a known answer wrong",
    "AMP-P01": "layers that can move to fp8 first",
    "AMP-P02": "layers to keep in bf16 when moving to fp8",
    "AMP-P03": "values that would not fit fp16",
    "AMP-P04": "layers that can move to a block-scaled format first",
    "AMP-P05": "layers to keep in bf16 when moving to a block-scaled format",
}


def checklist_ref(rule_id: str) -> str:
    """``"NaN checklist #9 (AMP-N09): unscale_ before clipping"`` for a checklist ID."""
    code = rule_id.removeprefix("AMP-")
    section = _SECTIONS.get(code[:1], "AMP checklist")
    number = int(code[1:]) if code[1:].isdigit() else None
    where = f"{section} #{number}" if number is not None else section
    title = CHECKLIST_TITLES.get(rule_id)
    return f"{where} ({rule_id})" + (f": {title}" if title else "")

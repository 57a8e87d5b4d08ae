"""A frozen model's decoder layers in float8: e4m3 weights with a scale per output row, each
activation row scaled on the fly, the matmul on the GPU's float8 tensor cores (twice bfloat16's
rate on an H100) through torch._scaled_mm. The embeddings, norms and output layer stay in bfloat16:
the output layer sets each log-prob, and the others are a small share of the work.

torchao's Float8DynamicActivationFloat8WeightConfig is this recipe; keel does not use it because
torchao 0.18 beside torch 2.11 (the GPU machine's) gave NaN logits on a tiny Qwen2 and compiled
each new length for 20 s, and a frozen layer needs nothing of it but the matmul."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from keel.errors import TEACHER_FLOAT8, KeelError

# float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
FLOAT8_CAPABILITY = (8, 9)
FLOAT8 = torch.float8_e4m3fn
# e4m3's largest finite value: each row is scaled so its largest magnitude lands there
FLOAT8_MAX = torch.finfo(FLOAT8).max
# _scaled_mm's inner and outer dimensions are multiples of this
FLOAT8_ALIGN = 16


def require_float8(device: torch.device) -> None:
    """KEEL-M011 unless float8 matmuls run fast on `device`, as the teacher's setting asks."""
    if device.type != "cuda":
        why = f"float8 matmuls need a CUDA GPU, and this run computes on {device.type}"
    elif torch.cuda.get_device_capability(device) < FLOAT8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        why = (
            f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no "
            "float8 tensor cores: they start at 8.9 (L4, L40S, H100, H200, B200)"
        )
    else:
        return
    raise KeelError(TEACHER_FLOAT8, f"distillation.teacher.dtype=float8: {why}")


def to_float8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """`x` [m, k] as e4m3 with one float32 scale per row -> (values [m, k], scales [m, 1]); a row
    of zeros keeps scale 1, not a division by zero."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FLOAT8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8), scale


class Float8Linear(nn.Module):
    """A frozen nn.Linear whose matmul runs in float8: its weight quantized once, each input row
    at every call, the product rescaled to the input's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = to_float8_rows(linear.weight.detach())
        # [out, in] row-major: its transpose is the column-major operand _scaled_mm takes
        self.register_buffer("weight", weight)
        # [1, out]
        self.register_buffer("weight_scale", scale.t().contiguous())
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        values, scale = to_float8_rows(rows)
        out = torch._scaled_mm(
            values,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16,
        )
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_layers_float8(model: nn.Module) -> nn.Module:
    """`model` (frozen) with every linear layer but the output layer a Float8Linear; a layer whose
    sizes _scaled_mm cannot take stays as it is."""
    output_layer = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child is not output_layer
                and child.in_features % FLOAT8_ALIGN == 0
                and child.out_features % FLOAT8_ALIGN == 0
            ):
                setattr(parent, name, Float8Linear(child))
    return model

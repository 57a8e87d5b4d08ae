"""A frozen model's decoder layers in float8: torchao's e4m3 weights with a scale per output row,
each activation row scaled on the fly, the matmuls on the GPU's float8 tensor cores (twice
bfloat16's rate on an H100). The embeddings, norms and output layer stay in bfloat16: the output
layer sets each log-prob, and the others are a small share of the work."""

from __future__ import annotations

import torch
from torch import nn

# float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
FLOAT8_CAPABILITY = (8, 9)


def float8_unavailable(device: torch.device) -> str | None:
    """Why float8 matmuls cannot run on `device`, or None where they can."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install 'keel[fp8]')"
    if device.type != "cuda":
        return f"float8 matmuls need a CUDA GPU, and this run computes on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} (compute capability {capability[0]}.{capability[1]}) has no float8 tensor "
            "cores: they start at 8.9 (L4, L40S, H100, H200, B200)"
        )
    return None


def quantize_layers_float8(model: nn.Module) -> nn.Module:
    """`model` (in bfloat16, frozen) with every linear layer but the output layer in float8."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    output_layer = model.get_output_embeddings()

    def in_decoder(module: nn.Module, _name: str) -> bool:
        return isinstance(module, nn.Linear) and module is not output_layer

    quantize_(
        model,
        Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        filter_fn=in_decoder,
    )
    return model

"""Drop-in replacements for trunk layers that PyTorch's CPU kernels run slowly in bf16.

Swapped in place (same parameters, same state_dict), so pretrained weights and checkpoints load
as before; on GPUs and in fp32 they compute what the layers they replace compute.
Measured at the LSS paper size, 2 threads (docs/training-speed.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _cpu_bf16_autocast() -> bool:
    """Whether CPU autocast to bf16 is on (bf16-mixed training on a CPU)."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def slow_bf16_depthwise(conv: nn.Module) -> bool:
    """Whether oneDNN lacks a bf16 depthwise backward kernel for this convolution: it has one for 3x3
    stride-1 filters only; the others (EfficientNet's 5x5 and strided ones) fall back to generic
    grouped kernels, slower than its fp32 depthwise ones (docs/training-speed.md)."""
    if not (isinstance(conv, nn.Conv2d) and 1 < conv.groups == conv.in_channels == conv.out_channels):
        return False
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):  # the backward takes numeric zero padding
        return False
    return conv.kernel_size != (3, 3) or conv.stride != (1, 1)


class _BF16ForwardFP32Backward(torch.autograd.Function):
    """conv2d in bf16 (oneDNN's fast depthwise forward) whose gradients are computed in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.has_bias = conv, bias is not None
        b = bias.to(torch.bfloat16) if bias is not None else None
        with torch.autocast("cpu", enabled=False):
            return F.conv2d(
                x.to(torch.bfloat16),
                weight.to(torch.bfloat16),
                b,
                conv.stride,
                conv.padding,
                conv.dilation,
                conv.groups,
            )

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        c = ctx.conv
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        w = weight.to(torch.bfloat16).float()  # the weight the forward used: the gradient of what was computed
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad.float(),
            x.float(),
            w,
            [weight.shape[0]] if ctx.has_bias else None,
            c.stride,
            c.padding,
            c.dilation,
            False,
            [0, 0],
            c.groups,
            mask,
        )
        return (gx.to(x.dtype) if gx is not None else None), gw, gb, None


class FP32GradDepthwiseConv2d(nn.Conv2d):
    """A depthwise Conv2d whose gradients are computed in fp32 under CPU bf16 autocast (the forward
    and its bf16 output stay as the autocast convolution it replaces computes them, with oneDNN's
    fast bf16 depthwise forward kernel); elsewhere, and without gradients, a plain Conv2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and torch.is_grad_enabled()
            and _cpu_bf16_autocast()
            and not torch.compiler.is_compiling()
        ):
            return _BF16ForwardFP32Backward.apply(x, self.weight, self.bias, self)
        return super().forward(x)


def fp32_depthwise(module: nn.Module) -> list[str]:
    """Turn the module's slow_bf16_depthwise convolutions into FP32GradDepthwiseConv2d; returns their names."""
    names = [name for name, m in module.named_modules() if slow_bf16_depthwise(m)]
    for name in names:
        module.get_submodule(name).__class__ = FP32GradDepthwiseConv2d
    return names


def spatial_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over H and W (the last two dims), kept as size-1 dims. A 4-d bf16 tensor on the CPU is
    summed by a matrix-vector product (fp32 accumulation; the sum rounded to bf16, divided in fp32:
    two roundings where ATen rounds once): ATen's bf16 mean goes through an fp32 copy and took
    13-15 ms at EfficientNet's largest squeeze-excitation inputs, the product 0.6-1 ms."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 4:
        return x.mean((-2, -1), keepdim=True)
    N, C, H, W = x.shape
    ones = x.new_ones(1, H * W)
    if x.is_contiguous(memory_format=torch.channels_last):
        total = torch.matmul(ones, x.permute(0, 2, 3, 1).reshape(N, H * W, C))
    else:
        total = torch.matmul(x.reshape(N, C, H * W), ones.T)
    return (total.float() / (H * W)).to(x.dtype).reshape(N, C, 1, 1)


class _SpatialMean(torch.autograd.Function):
    """spatial_mean whose gradient stays an expanded (stride-0) tensor: autograd adds it into the
    gradient of the input's other use (x * scale) instead of first writing a full-size copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return spatial_mean(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        H, W = ctx.shape[-2:]
        return (grad / (H * W)).expand(ctx.shape)


class GlobalAvgPool(nn.Module):
    """nn.AdaptiveAvgPool2d(1) (the squeeze of squeeze-and-excitation) by spatial_mean and _SpatialMean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad):
            return spatial_mean(x)
        return _SpatialMean.apply(x)


def fast_global_pools(module: nn.Module) -> int:
    """Replace the module's AdaptiveAvgPool2d(1) layers (no parameters) by GlobalAvgPool; returns how many."""
    names = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.AdaptiveAvgPool2d) and m.output_size in (1, (1, 1))
    ]
    for name in names:
        module.set_submodule(name, GlobalAvgPool())
    return len(names)

"""`trainer.precision: auto`: bf16 mixed precision where the hardware runs bf16 natively, fp32 elsewhere;
`channels_last: auto`: NHWC convolutions on the same hardware.

bf16 autocast halves the cost of the convolutions only on CPUs with native bf16 instructions
(AVX512-BF16, AMX, Arm BF16); elsewhere oneDNN emulates them and fp32 is as fast or faster
(scripts/bench_train.py measures both). On GPUs bf16 needs compute capability 8.0 (Ampere);
older GPUs get fp16 mixed precision with loss scaling. The splat accumulates in fp32 and the
geometry runs in fp32 under autocast (bev.models.lift), so only the encoders change precision.
"""

from __future__ import annotations

import os
import warnings

# /proc/cpuinfo flags of native bf16 arithmetic, and how to name them in messages.
CPU_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "bf16": "Arm BF16"}


def _cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below its native bf16 kernels: with one set, bf16 is emulated.
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_bf16_support() -> str | None:
    """The name of this CPU's native bf16 instructions (e.g. "AVX512-BF16"), or None; None too when
    ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) keeps oneDNN below them, as on a CPU without them."""
    return None if _isa_cap() in ONEDNN_ISAS_WITHOUT_BF16 else _native_flag()


def trains_in_fp32_on_cpu() -> bool:
    """Whether training here runs in fp32 on the CPU: no CUDA GPU and no native bf16 (precision auto's 32-true)."""
    import torch

    return not torch.cuda.is_available() and cpu_bf16_support() is None


def _isa_cap() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def _native_flag() -> str | None:
    """The name of the CPU's native bf16 instructions by its flags alone."""
    flags = _cpu_flags()
    return next((name for flag, name in CPU_BF16_FLAGS.items() if flag in flags), None)


def _accelerator(accelerator: str) -> str:
    import torch

    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def resolve_precision(precision: str | int | None, accelerator: str = "auto") -> tuple[str, str]:
    """(Lightning precision, reason) for `trainer.precision`; anything but "auto" is returned as given."""
    if str(precision) != "auto":
        return str(precision), "as configured"
    import torch

    device = _accelerator(str(accelerator))
    if device == "cuda":
        if not torch.cuda.is_available():
            return "32-true", "no CUDA device visible"
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"{name} supports bf16"
        return "16-mixed", f"{name} has no bf16"
    if device == "cpu":
        native = cpu_bf16_support()
        if native:
            return "bf16-mixed", f"CPU has {native}"
        cap = _isa_cap()
        if cap in ONEDNN_ISAS_WITHOUT_BF16 and _native_flag():
            return "32-true", f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN below its bf16 kernels: emulated bf16 is slower"
        return "32-true", "CPU has no native bf16 (no AVX512-BF16 / AMX): emulated bf16 is slower than fp32"
    return "32-true", f"no bf16 rule for accelerator {accelerator!r}"


def resolve_channels_last(value: bool | str, module=None) -> bool:
    """`channels_last` of the encoders: True/False as given; "auto": on GPUs and on CPUs with native bf16, and on
    CPUs that train in fp32 for a `module` of dense convolutions alone (no grouped ones); never for a module with a
    convolution oneDNN's NHWC backward gets wrong (nhwc_hazards).

    In fp32 on the CPU NHWC pays for dense convolutions and loses on depthwise ones (EfficientNet's):
    docs/training-speed.md.
    """
    if isinstance(value, str) and value != "auto":
        raise ValueError(f"channels_last must be true, false or auto, got {value!r}")
    hazards = nhwc_hazards(module) if module is not None and value else []
    if hazards:
        choice = "keeps NCHW" if value == "auto" else "channels_last=true as configured"
        warnings.warn(
            f"{type(module).__name__}: {choice}: {len(hazards)} convolution(s) ({hazards[0]}, ...) are 1x1 "
            f"with stride > 1 and fewer than {NHWC_MIN_CHANNELS} input channels, whose channels_last weight gradient "
            "oneDNN on x86 CPUs computes past its buffer (crashes, hangs or wrong gradients: "
            "uxlfoundation/oneDNN#6035); widen them or set channels_last=false",
            stacklevel=3,
        )
    if value != "auto":
        return bool(value)
    return not hazards and (not trains_in_fp32_on_cpu() or _dense_convolutions(module))


def _dense_convolutions(module) -> bool:
    """Whether `module` has 2D convolutions and none of them grouped (depthwise)."""
    from torch import nn

    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)] if module is not None else []
    return bool(convs) and all(m.groups == 1 for m in convs)


# oneDNN's AVX-512 1x1 convolution blocks input channels by 16; below one block its strided
# NHWC backward-weights kernel overruns its workspace (seen here on an AMD EPYC with AVX512-BF16:
# 8 or 12 input channels, 12x12 input, batch 2, 3-4 threads: segfault).
NHWC_MIN_CHANNELS = 16


def nhwc_hazards(module) -> list[str]:
    """Names of the module's Conv2d layers that are 1x1, strided and narrower than NHWC_MIN_CHANNELS."""
    from torch import nn

    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.Conv2d)
        and m.kernel_size == (1, 1)
        and max(m.stride) > 1
        and m.in_channels < NHWC_MIN_CHANNELS
    ]


def available_memory(accelerator: str = "cpu") -> int | None:
    """Bytes the training device can still give: the GPU's free memory, or the host's MemAvailable
    (Linux); None where unknown."""
    if _accelerator(accelerator) == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None

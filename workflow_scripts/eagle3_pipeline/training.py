"""train_drafter: train speculators' ``Eagle3DraftModel`` from hidden-state shards.

Everything model-side is speculators' own but the draft decoder's config
(:func:`draft_decoder_config`, speculators' default shape built from transformers' public
config API), the model (``Eagle3DraftModel.from_training_args``,
which loads the target's embeddings, final norm and the draft-vocab rows of its
``lm_head``), the token shift (``shift_batch``), packing (``MultipackDistributedBatchSamplerV2``
+ ``CollateFn``), the loss (``resolve_loss_config``) and metrics, the optimizers
(``build_optimizers``) and checkpoint dtype handling. This module only feeds it our
shards and runs the loop, because ``speculators train`` refuses to run without an
accelerator and reads a different on-disk format.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.profiler import record_function

from .config import runtime_keys
from .conventions import drafter_aux_columns, prompt_of, repetition_loop
from .io import InputError, atomic_dir, check_recorded_files, record_files, sha256_file, sha256_json, write_text_atomic
from .layout import checkpoint_beside
from .resume import finished_by_another_job, take_back_kept
from .runtime import Timer, progress
from .shards import ShardReader
from .vocab import load_mapping

logger = logging.getLogger(__name__)

#: The parts of a training step, by the label :func:`train` gives each for ``torch.profiler``
#: (``record_function``; no cost beyond a few microseconds when no profiler runs): waiting for
#: the next packed micro-batch from the loader, its copy to the device, the forward (TTT steps
#: and loss), the backward, the optimizer (gradient clipping, optimizer and scheduler steps), and
#: the metrics' read-back (an all-reduce, then a copy to the host that waits for the device to
#: finish the step).
STEP_PHASES = {k: f"train_step/{k}" for k in ("load", "h2d", "forward", "backward", "optimizer", "metrics")}


def _base_dataset():
    from speculators.train.data import BaseDataset

    return BaseDataset


class ShardDataset(_base_dataset()):  # type: ignore[misc]
    """speculators training samples read from hidden-state shards.

    Each item is speculators' unshifted sample dict: ``hidden_states``
    ``[T, A*H]`` (the drafter's aux layers, ``aux_columns`` of the stored ones or all,
    concatenated in ascending layer order),
    ``verifier_last_hidden_states`` ``[T, H]`` (final layer, pre-norm), ``input_ids``
    int64 ``[T]``, ``loss_mask`` bool ``[T]`` (+ ``lengths``, ``position_ids`` added by
    ``BaseDataset``).
    """

    def __init__(
        self,
        readers: list[ShardReader],
        items: list[tuple[int, int]],
        max_len: int,
        hidden_states_dtype: torch.dtype,
        aux_columns: list[int] | None = None,
        loss_end: Mapping[tuple[int, int], int] | None = None,
    ):
        self.readers = readers
        self.items = items
        self.aux_columns = aux_columns  # which stored aux layers the drafter uses (None: all)
        self.loss_end = loss_end or {}  # (shard, sample) -> first position without loss (looping_answers: trim)
        super().__init__(max_len=max_len, hidden_states_dtype=hidden_states_dtype)

    def __len__(self) -> int:
        return len(self.items)

    def _compute_approx_lengths(self) -> list[int]:
        lens = [r.lengths() for r in self.readers]
        return [lens[s][i] for s, i in self.items]

    def _get_raw_data(self, index: int) -> dict:
        s, i = self.items[index]
        reader = self.readers[s]
        n_stored = len(reader.layer_ids)  # the stored aux layers, then the final layer
        aux_cols = list(range(n_stored - 1)) if self.aux_columns is None else list(self.aux_columns)
        smp = reader.sample(i, layers=[*aux_cols, n_stored - 1])  # only what the drafter reads is dequantised
        hs = smp["hidden_states"]  # [T, A + 1, H]: the drafter's aux layers, then the final layer
        t, n, h = hs.shape
        mask = smp["loss_mask"].bool()
        if (s, i) in self.loss_end:
            mask = mask.clone()
            mask[self.loss_end[s, i] :] = False
        return {
            "hidden_states": hs[:, : n - 1].reshape(t, (n - 1) * h).to(self.hidden_states_dtype),
            "verifier_last_hidden_states": hs[:, n - 1].to(self.hidden_states_dtype),
            "input_ids": smp["input_ids"].long(),
            "loss_mask": mask,
        }


def looping_answers(
    readers: list[ShardReader], items: list[tuple[int, int]], mode: str
) -> tuple[list[tuple[int, int]], dict[tuple[int, int], int], dict]:
    """Apply ``training.looping_answers`` to training ``items``.

    An answer loops when its supervised tokens (loss mask on) end in a repetition loop
    (:func:`eagle3_pipeline.conventions.repetition_loop`).

    Args:
        readers: the shards.
        items: ``(shard index, sample index)`` of the training split.
        mode: ``keep`` (count only), ``trim`` (no loss from the loop's first token on; an answer
            whose supervised tokens are all loop is dropped) or ``drop``.

    Returns:
        ``(items kept, loss_end, counts)``: ``loss_end`` maps a trimmed item to the first
        position (token index in its sample) without loss; ``counts`` is ``{"mode", "found",
        "trimmed", "dropped", "tokens_unsupervised"}`` (supervised tokens taken out by trim or drop).
    """
    kept, loss_end = [], {}
    counts = {"mode": mode, "found": 0, "trimmed": 0, "dropped": 0, "tokens_unsupervised": 0}
    for s, i in items:
        r = readers[s]
        a, b = int(r.offsets[i]), int(r.offsets[i + 1])
        supervised = np.flatnonzero(r.loss_mask[a:b].numpy())
        start = repetition_loop(r.input_ids[a:b].numpy()[supervised]) if len(supervised) else None
        if start is None:
            kept.append((s, i))
            continue
        counts["found"] += 1
        if mode == "keep":
            kept.append((s, i))
        elif mode == "trim" and start > 0:
            loss_end[s, i] = int(supervised[start])
            counts["trimmed"] += 1
            counts["tokens_unsupervised"] += len(supervised) - start
            kept.append((s, i))
        else:
            counts["dropped"] += 1
            counts["tokens_unsupervised"] += len(supervised)
    return kept, loss_end, counts


def split_items(
    readers: list[ShardReader], val_fraction: float, max_train_samples: int | None = None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split samples into train/validation by a hash of their prompt's id: deterministic.

    A sample is validation when the first 8 bytes of ``sha256("val:" + prompt id)``, read as
    a fraction of 2**64, fall below ``val_fraction``; the prompt id
    (:func:`eagle3_pipeline.conventions.prompt_of`) is the sample id for one answer per prompt, and
    keeps every answer of a prompt on one side (``generation.answers_per_prompt``). The id itself is not used directly:
    ``prompts.max_prompts`` keeps the lowest ids, which would all land on one side.
    At least one sample stays in training. ``max_train_samples`` keeps the first N training
    samples in shard order (training.max_train_samples); validation is the same for any N.

    Returns:
        ``(train, val)``: lists of ``(shard index, sample index)``.
    """
    train, val = [], []
    for s, r in enumerate(readers):
        for i, sid in enumerate(r.sample_ids):
            u = int.from_bytes(hashlib.sha256(f"val:{prompt_of(sid)}".encode()).digest()[:8], "big") / 2**64
            (val if u < val_fraction else train).append((s, i))
    if not train:
        train, val = val[:1], val[1:]
    return train[:max_train_samples] if max_train_samples else train, val


def resolve_device(device: str) -> str:
    """``"auto"`` → ``"cuda"`` when available, else ``"cpu"``.

    Raises:
        InputError: ``device`` is a CUDA device torch does not see
            (:func:`eagle3_pipeline.precision.check_device_available`).
    """
    from .precision import check_device_available

    check_device_available(device, "training.device")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class DistContext:
    """This process's place in a (torchrun) training job.

    Attributes:
        rank: global rank (0 writes every output).
        world_size: number of processes (1 without torchrun).
        device: ``cuda:<local rank>`` on GPUs, ``cpu`` otherwise.
        parallelism: ``"none"``, ``"ddp"`` or ``"fsdp"``.
    """

    def __init__(self, rank: int, world_size: int, device: str, parallelism: str):
        self.rank, self.world_size, self.device, self.parallelism = rank, world_size, device, parallelism

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum scalar tensors over ranks (one collective); plain floats back."""
        if not values:
            return {}
        keys = list(values)
        stacked = torch.stack([values[k].detach().float().reshape(()).to(self.device) for k in keys])
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return dict(zip(keys, stacked.tolist(), strict=True))


def init_distributed(device_cfg: str, parallelism: str) -> DistContext:
    """Join the torchrun job this process belongs to (``LOCAL_RANK`` set), else a single-process context.

    NCCL on GPUs (each rank on ``cuda:<LOCAL_RANK>``), gloo on CPU (tests).
    """
    if "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistContext(0, 1, resolve_device(device_cfg), "none")
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    if resolve_device(device_cfg).startswith("cuda"):
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        device = "cpu"
        dist.init_process_group("gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), device, parallelism)


def _wrap(model, ctx: DistContext, param_dtype: torch.dtype):
    """The model to train: DDP, FSDP (speculators' ``apply_fully_sharded``) or as is."""
    if ctx.parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[torch.device(ctx.device)] if ctx.device.startswith("cuda") else None)
    if ctx.parallelism == "fsdp":
        from speculators.train.distributed import apply_fully_sharded

        return apply_fully_sharded(model, param_dtype=param_dtype)
    return model


def _full_state(model, optimizers, ctx: DistContext) -> tuple[dict, list[dict]]:
    """Full (unsharded) model and optimizer state dicts on CPU; a collective under FSDP."""
    if ctx.parallelism == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts), [get_optimizer_state_dict(model, o, options=opts) for o in optimizers]
    base = model.module if ctx.parallelism == "ddp" else model
    return base.state_dict(), [o.state_dict() for o in optimizers]


def _load_full_state(model, optimizers, state: dict, ctx: DistContext) -> None:
    if ctx.parallelism == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=opts)
        for o, sd in zip(optimizers, state["optimizers"], strict=True):
            set_optimizer_state_dict(model, o, sd, options=opts)
        return
    (model.module if ctx.parallelism == "ddp" else model).load_state_dict(state["model"])
    for o, sd in zip(optimizers, state["optimizers"], strict=True):
        o.load_state_dict(sd)


def draft_decoder_config(target_path: str, num_layers: int, max_seq_len: int, trust_remote_code: bool = False):
    """The draft decoder of a fresh drafter: ``num_layers`` full-attention Llama layers shaped after the target.

    The shape is speculators 0.9's default EAGLE-3 draft (``speculators train`` without
    ``--draft-config``, draft architecture ``llama``): the target's (text) hidden size, heads
    and KV heads (heads re-derived from ``head_dim`` when the hidden size is not a multiple of
    the head count), norm epsilon, initializer range, positions and rope settings
    (a per-layer-type rope collapsed to one, preferring the sliding-attention one; legacy
    ``type``, ``mrope_interleaved`` and ``partial_rotary_factor`` dropped), untied embeddings,
    and the target's dense MLP width (3 x hidden size for an MoE target without one). The
    activation is SiLU whatever the target's: speculators copies the target's, but vLLM's Llama
    draft layer takes SiLU only (``LlamaMLP``: "Only silu is supported for now"), so a Gemma
    target's ``gelu_pytorch_tanh`` gave a drafter that trained and then failed to load in vLLM.

    Args:
        target_path: the target model directory.
        num_layers: draft decoder layers (``training.draft_layers``).
        max_seq_len: the config's ``sliding_window`` (unused: every layer has full attention,
            which vLLM honours).
        trust_remote_code: passed to ``AutoConfig``.

    Returns:
        a ``transformers.LlamaConfig``.

    Raises:
        InputError: the target has inconsistent attention heads, or a multimodal rope
            (``mrope_section``), which this drafter does not support.
    """
    from copy import deepcopy

    from transformers import LlamaConfig

    from .target_model import text_config

    v = text_config(target_path, trust_remote_code)
    hidden, heads, kv = v.hidden_size, v.num_attention_heads, v.num_key_value_heads
    head_dim = getattr(v, "head_dim", None)
    if head_dim and hidden % heads and hidden % head_dim == 0:
        heads = hidden // head_dim
        kv = kv if heads % kv == 0 else heads
    if kv and heads % kv:
        raise InputError(f"{target_path}: {heads} attention heads are not a multiple of {kv} KV heads; cannot shape a draft layer")
    dense = getattr(v, "intermediate_size", None)
    config = LlamaConfig(
        vocab_size=v.vocab_size,
        hidden_size=hidden,
        intermediate_size=int(dense) if dense is not None else 3 * int(hidden),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_act="silu",  # vLLM's Llama draft layer takes no other (the docstring)
        max_position_embeddings=v.max_position_embeddings,
        initializer_range=v.initializer_range,
        rms_norm_eps=v.rms_norm_eps,
        head_dim=head_dim,
        tie_word_embeddings=False,
        sliding_window=max_seq_len,
        use_sliding_window=False,
        layer_types=["full_attention"] * num_layers,
    )
    rope = deepcopy(getattr(v, "rope_parameters", None))
    if isinstance(rope, dict) and "rope_theta" not in rope:  # {"full_attention": {...}, "sliding_attention": {...}}
        sub = rope.get("sliding_attention") or rope.get("full_attention") or {}
        rope = {"rope_type": "default", "rope_theta": 10000.0} | (dict(sub) if isinstance(sub, dict) else {})
    if isinstance(rope, dict):
        if "mrope_section" in rope:
            raise InputError(f"{target_path}: a multimodal rope (mrope_section) target is not supported for the draft layer")
        for key in ("type", "mrope_interleaved", "partial_rotary_factor"):
            rope.pop(key, None)
    if hasattr(v, "rope_parameters"):
        config.rope_parameters = rope
    return config


def build_drafter(
    target_path: str, d2t: np.ndarray, t2d: np.ndarray, aux_layer_ids: list[int], cfg: dict, device: str, trust_remote_code: bool = False
):
    """The ``Eagle3DraftModel`` to train, by speculators' own builders.

    Fresh: the draft decoder is a Llama layer stack shaped after the target
    (:func:`draft_decoder_config`) with ``cfg["draft_layers"]`` layers, all with
    full attention (vLLM honours it; no sliding window to mismatch); embeddings, final
    norm and the draft-vocab rows of ``lm_head`` come from the target.

    Warm start (``cfg["init_from"]``): the earlier drafter's weights and config, with
    its verifier re-pointed at ``target_path``.

    Raises:
        InputError: the warm-start drafter's aux layer ids or draft vocab differ from
            this run's (re-extract with its layer ids, or start fresh).
    """
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    attn = cfg["attn_implementation"]
    if attn == "auto":
        attn = "simple_flex_attention" if device.startswith("cuda") else "sdpa"
    if cfg.get("init_from"):
        config = Eagle3SpeculatorConfig.from_pretrained(cfg["init_from"])
        if list(config.eagle_aux_hidden_state_layer_ids or []) != list(aux_layer_ids):
            raise InputError(
                f"training.init_from={cfg['init_from']} uses aux layer ids {config.eagle_aux_hidden_state_layer_ids}, "
                f"the drafter to train uses {list(aux_layer_ids)}; set training.aux_layer_ids (or extraction.aux_layer_ids) to match"
            )
        if config.draft_vocab_size != d2t.shape[0]:
            raise InputError(f"training.init_from={cfg['init_from']} has draft vocab {config.draft_vocab_size}, this run {d2t.shape[0]}")
        config.transformer_layer_config._attn_implementation = attn
        config.speculators_config.verifier.name_or_path = target_path
        model = Eagle3DraftModel.from_pretrained(cfg["init_from"], config=config, t2d=torch.from_numpy(t2d), d2t=torch.from_numpy(d2t))
        return model.to(device=device, dtype=torch.float32)

    tl_config = draft_decoder_config(target_path, cfg["draft_layers"], cfg["max_seq_len_hint"], trust_remote_code)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=tl_config,
        t2d=torch.from_numpy(t2d),
        d2t=torch.from_numpy(d2t),
        verifier_name_or_path=target_path,
        target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=int(d2t.shape[0]),
        norm_before_residual=cfg["norm_before_residual"],
        norm_before_fc=cfg["norm_before_fc"],
        norm_output=cfg["norm_output"],
        ttt_steps=cfg["ttt_steps"],
        draft_attn_impl=attn,
        trust_remote_code=trust_remote_code,
    )
    return model.to(device)


def _optimizer_config(cfg: dict) -> SimpleNamespace:
    return SimpleNamespace(
        optimizer=cfg["optimizer"],
        lr=cfg["lr"],
        weight_decay=cfg["weight_decay"],
        muon_lr=cfg["lr"],
        muon_momentum=0.95,
        muon_weight_decay=0.1,
        muon_ns_steps=5,
        muon_adjust_lr_fn="match_rms_adamw",
    )


def _loader(dataset: ShardDataset, total_seq_len: int, hidden_size: int, num_aux: int, seed: int):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=dataset.approx_lengths, num_replicas=1, rank=0, seed=seed
    )
    collate = CollateFn(total_seq_len, hidden_size, num_target_layers=num_aux, dtype=dataset.hidden_states_dtype, preprocess=shift_batch)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0)


def _step_metrics(metrics: dict, parts: int = 1) -> dict:
    """speculators' counted metrics (``*_sum``/``*_total`` pairs) summed over ``parts`` micro-batches, normalised."""
    from speculators.train.utils import normalize_counted_metrics

    return normalize_counted_metrics({k: float(v) for k, v in metrics.items()}, parts)


def _barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def training_dtypes(cfg: dict, device: str) -> tuple[torch.dtype, torch.dtype | None]:
    """``(hidden-state dtype, autocast dtype or None)`` for ``training.hidden_states_dtype``
    and ``training.autocast`` on ``device``.

    ``auto`` is bf16 (speculators' recipe) on a GPU or a CPU with fast bf16, and float32 /
    no autocast on a CPU without it (:func:`eagle3_pipeline.precision.resolve_dtype`);
    explicit values are used as given.
    """
    from .precision import resolve_dtype

    hs = resolve_dtype(cfg["hidden_states_dtype"], device, "training.hidden_states_dtype") or "bfloat16"
    ac = cfg["autocast"]
    if ac == "auto":
        ac = "none" if resolve_dtype("auto", device, "training.autocast") == "float32" else "bfloat16"
    return getattr(torch, hs), (torch.bfloat16 if ac == "bfloat16" else None)


def _batch_to(batch: dict, device: str) -> dict:
    keep = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    return {k: batch[k].to(device, non_blocking=True) for k in keep}


def loader_workers(cfg: dict, device: str) -> int:
    """Loader processes that read and pack the next micro-batches while the device computes.

    ``cfg["loader_workers"]`` when set; else 4 on a GPU (speculators' own trainer uses
    worker processes too: a pack of an 8B target's states is ~270 MB to read, concatenate
    and copy) and 0 on a CPU, where workers would take cores from the training itself.
    """
    if cfg.get("loader_workers") is not None:
        return int(cfg["loader_workers"])
    return 4 if device.startswith("cuda") else 0


def micro_batches(dataset, collate, packs: list[list[int]], *, workers: int, pin_memory: bool):
    """Iterator of collated micro-batches, one per entry of ``packs``, in order.

    Args:
        dataset: a :class:`ShardDataset` (item ``i``: one sample's tensors).
        collate: speculators' ``CollateFn`` (the training loader's ``collate_fn``): a pack's
            samples concatenated into one zero-padded row of ``L = total_seq_len`` tokens,
            ``hidden_states`` ``[1, L, A*H]`` and ``verifier_last_hidden_states`` ``[1, L, H]``
            in the dataset's ``hidden_states_dtype``, ``input_ids`` / ``position_ids`` int64
            ``[1, L]``, ``loss_mask`` ``[1, L]``, ``document_ids`` int64 ``[1, L]`` (the
            sample's index in the pack, -1 on padding).
        packs: per micro-batch, the dataset indices of its samples (a pack of speculators'
            ``MultipackDistributedBatchSamplerV2``, this rank's share of each step).
        workers: forked loader processes (0: read in this process).
        pin_memory: collate into page-locked host memory, so that the host-to-device copy
            (``_batch_to(..., non_blocking)``) overlaps the GPU's work.

    With ``workers > 0`` each process reads and collates up to 4 packs ahead (torch's
    ``DataLoader`` with ``batch_sampler=packs``); the batches are the same as with
    ``workers = 0`` (collation is deterministic), only their timing changes. An empty
    ``packs`` gives an empty iterator (no loader processes started).
    """
    from torch.utils.data import DataLoader

    if not packs:
        return iter(())
    return iter(
        DataLoader(
            dataset,
            batch_sampler=packs,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=pin_memory,
            prefetch_factor=4 if workers else None,
        )
    )


def evaluate_offline(
    model, loader, call_kwargs: dict, device: str, autocast_dtype, d2t: np.ndarray | None = None, replay_max_tokens: int | None = None
) -> dict:
    """Validation metrics: speculators' loss and per-position full/conditional accuracy (token-weighted sums),
    and, given ``d2t``, what vLLM would measure on the same answers.

    Args:
        model: the speculators ``Eagle3DraftModel`` (put in eval mode for the pass, back in
            train mode after it).
        loader: micro-batches as :func:`micro_batches` yields them (CPU tensors).
        call_kwargs: the model's forward keywords (``ttt_steps``, the loss, ...), as training's step passes them.
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``; autocast runs on its type.
        autocast_dtype: ``torch.bfloat16`` / ``torch.float16``, or None for no autocast.
        d2t: int64 ``[draft_vocab]``, draft id -> target id offsets (:func:`eagle3_pipeline.conventions.draft_to_target`).
        replay_max_tokens: see below.

    Returns:
        ``{metric: float}``: speculators' normalised metrics (``loss``, ``full_acc_j``,
        ``cond_acc_j``, ...) and, given ``d2t``, ``replay_tau`` and ``replay_acc_j``; ``{}``
        for an empty loader.

    ``replay_tau`` and ``replay_acc_j`` (``j < ttt_steps``) replay greedy speculative decoding
    with ``k = ttt_steps`` over each validation answer (:mod:`eagle3_pipeline.acceptance`): τ
    and the per-draft-step acceptance rates vLLM's counters would report, where ``full_acc_j``
    weights every token alike. ``replay_max_tokens`` ends each replayed answer after that many
    tokens, as ``evaluation.max_tokens`` ends vLLM's (``None``: whole answers).
    """
    from .acceptance import accepted_lengths, add_counters, draft_target_ids, replay_decoding
    from .evaluation import acceptance_report

    model.eval()
    sums: dict[str, float] = defaultdict(float)
    counters = None
    k = call_kwargs["ttt_steps"]
    with torch.no_grad():
        for batch in loader:
            with torch.autocast(device.split(":")[0], dtype=autocast_dtype, enabled=autocast_dtype is not None):
                drafts, _, metrics = model(**_batch_to(batch, device), **call_kwargs)
            for key, v in metrics.items():
                sums[key] += float(v)
            if d2t is not None:
                ids, mask, doc = (batch[name].reshape(-1).numpy() for name in ("input_ids", "loss_mask", "document_ids"))
                acc, anchors = accepted_lengths(draft_target_ids(drafts, d2t), ids, mask, doc)
                counters = add_counters(counters, replay_decoding(acc, anchors, doc, k, replay_max_tokens))
    model.train()
    out = _step_metrics(dict(sums)) if sums else {}
    if counters is not None and counters["num_drafts"]:
        rep = acceptance_report(counters, k)
        out["replay_tau"] = rep["acceptance_length"]
        out |= {f"replay_acc_{j}": r for j, r in enumerate(rep["per_position_acceptance_rate"])}
    return out


def evaluate_checkpoint(
    drafter_dir: str,
    target_path: str,
    shards: list[str],
    sample_ids: list[str] | None,
    cfg: dict,
    *,
    ttt_steps: int,
    max_seq_len: int,
    replay_max_tokens: int | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """A finished drafter's offline metrics on stored samples, computed as training's validation computes them.

    Args:
        drafter_dir: a speculators-format drafter (``results/<run>/drafter``).
        shards: hidden-state shards holding the samples (their stored layers must include
            the drafter's aux layer ids).
        sample_ids: the samples to evaluate (``None``: every sample of the shards).
        cfg: the validated ``training:`` section (device, dtypes, loss, pack size).
        ttt_steps: draft steps to run and replay (``k``; at most the drafter's own).

    Returns:
        :func:`evaluate_offline`'s metrics plus ``samples`` and ``tokens``.

    Raises:
        InputError: a sample id is in none of the shards.
    """
    from speculators.losses import resolve_loss_config

    device = resolve_device(cfg["device"])
    readers = [ShardReader(p) for p in shards]
    where = {sid: (s, i) for s, r in enumerate(readers) for i, sid in enumerate(r.sample_ids)}
    missing = [sid for sid in sample_ids or [] if sid not in where]
    if missing:
        raise InputError(f"{len(missing)} sample(s) are in none of {shards}: {missing[:3]}")
    items = [where[sid] for sid in sample_ids] if sample_ids is not None else sorted(where.values())
    model = load_drafter(drafter_dir, target_path, cfg, device, trust_remote_code)
    try:
        aux, aux_columns = drafter_aux_columns(model.config.eagle_aux_hidden_state_layer_ids, readers[0].aux_layer_ids)
    except ValueError as e:
        raise InputError(f"{drafter_dir}: {e} ({readers[0].path})") from None
    d2t = model.d2t.cpu().numpy()
    hs_dtype, autocast = training_dtypes(cfg, device)
    total_seq_len = max(cfg["pack_tokens"], max_seq_len)
    loader = _loader(ShardDataset(readers, items, total_seq_len, hs_dtype, aux_columns), total_seq_len, model.hidden_size, len(aux), 0)
    call_kwargs = {
        "ttt_steps": ttt_steps,
        "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
        "loss_config": resolve_loss_config(cfg["loss"], "eager"),
    }
    out = evaluate_offline(model, loader, call_kwargs, device, autocast, d2t, replay_max_tokens)
    lengths = [readers[s].lengths()[i] for s, i in items]
    return out | {"samples": len(items), "tokens": int(sum(lengths))}


def load_drafter(drafter_dir: str, target_path: str, cfg: dict, device: str, trust_remote_code: bool = False):
    """A finished drafter as speculators' ``Eagle3DraftModel`` (float32 on ``device``), its verifier
    re-pointed at ``target_path``: the warm-start path of :func:`build_drafter` with the drafter's own
    aux layer ids and draft vocab (``d2t``/``t2d``, which speculators keeps in the weights).

    Raises:
        InputError: the directory's weights hold no ``d2t``/``t2d`` (not a speculators EAGLE-3 drafter).
    """
    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    aux = list(Eagle3SpeculatorConfig.from_pretrained(drafter_dir).eagle_aux_hidden_state_layer_ids)
    for f in sorted(Path(drafter_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="np") as sf:
            if {"d2t", "t2d"} <= set(sf.keys()):
                d2t, t2d = sf.get_tensor("d2t").astype(np.int64), sf.get_tensor("t2d").astype(bool)
                return build_drafter(target_path, d2t, t2d, aux, {**cfg, "init_from": drafter_dir}, device, trust_remote_code)
    raise InputError(f"{drafter_dir}: no d2t/t2d tensors in its weights; is it a speculators EAGLE-3 drafter?")


class TrainCheckpoint:
    """The training state of an unfinished run, saved atomically to resume after a kill.

    Holds model, optimizer and scheduler states, step, position in the epoch, RNG state
    and the metrics so far (``torch.save`` of a dict), under a fingerprint of the run's
    inputs and settings; a checkpoint with another fingerprint is ignored and replaced.
    ``progress.json`` beside it records the SHA-256 of ``state.pt``, taken while it is written,
    which a resume checks before it loads the state.
    """

    def __init__(self, directory: Path, fingerprint: str):
        self.dir = directory
        self.fingerprint = fingerprint

    def load(self) -> dict | None:
        """The saved state, or None when there is none or it belongs to other inputs or settings.

        Raises:
            InputError: ``state.pt`` exists but its bytes differ from the SHA-256 recorded when it
                was saved, or it cannot be read (truncated or damaged after it was saved); the
                message names it and says to delete the checkpoint folder, which restarts this
                training from step 0.
        """
        path = self.dir / "state.pt"
        if not path.is_file():
            if (self.dir / "progress.json").is_file():
                logger.warning("%s has progress.json but no state.pt: training starts from step 0", self.dir)
            return None
        try:
            recorded = json.loads((self.dir / "progress.json").read_text(encoding="utf-8")).get("state_sha256")
        except (OSError, ValueError, AttributeError):
            recorded = None  # an earlier version's checkpoint, or no progress.json: loaded unchecked
        if recorded is not None and (got := sha256_file(path)) != recorded:
            raise InputError(
                f"{path}: the training checkpoint's SHA-256 is {got}, not the {recorded} recorded in progress.json when it "
                f"was saved: it was changed after. Delete {self.dir} and rerun: this training starts again from step 0"
            )
        try:
            state = torch.load(path, weights_only=False)
        except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
            raise InputError(
                f"{path}: the training checkpoint cannot be read ({type(e).__name__}: {str(e)[:200]}); it was damaged "
                f"after it was saved. Delete {self.dir} and rerun: this training starts again from step 0"
            ) from e
        if state.get("fingerprint") != self.fingerprint:
            logger.warning("ignoring the training checkpoint in %s: inputs or settings changed", self.dir)
            return None
        return state

    def save(self, state: dict) -> None:
        """Write ``state`` (``torch.save``) and, beside it, ``progress.json``: where the run stands.

        ``progress.json`` holds ``step``, ``total_steps``, ``epoch`` and ``tokens_seen`` from
        ``state`` (what :func:`eagle3_pipeline.resume.kept_work` reports after an interrupted
        run, without loading the tensors) and ``state_sha256``, the SHA-256 of the bytes
        ``torch.save`` wrote, which :meth:`load` checks.
        """

        class HashingFile:  # what torch.save writes, hashed on its way to the file
            def __init__(self, f):
                self.f, self.sha = f, hashlib.sha256()

            def write(self, data) -> int:
                self.sha.update(data)
                return self.f.write(data)

            def flush(self) -> None:
                self.f.flush()

        with atomic_dir(self.dir) as tmp:
            with open(tmp / "state.pt", "wb") as f:
                out = HashingFile(f)
                torch.save({**state, "fingerprint": self.fingerprint}, out)
            meta = {k: state.get(k) for k in ("step", "total_steps", "epoch", "tokens_seen")}
            meta["state_sha256"] = out.sha.hexdigest()
            (tmp / "progress.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _train_fingerprint(shards: list[str], vocab_dir: str, target_path: str, cfg: dict, seed: int, max_seq_len: int) -> str:
    """Identity of a training run: shard checksums (their indexes' records, checked against the bytes
    on disk: :func:`eagle3_pipeline.io.checked_sha256`), vocab, target, settings.

    Raises:
        InputError: a shard's bytes differ from its index's record, or a vocab file's from
            build_vocab_mapping's record.
    """
    from .shards import recorded_shard_sha256
    from .target_model import quick_identity

    shard_ids = [recorded_shard_sha256(p) for p in shards]
    recorded = check_recorded_files(vocab_dir, directory_output=False) or {}  # build_vocab_mapping's record, checked
    vocab = [recorded.get(f) or sha256_file(Path(vocab_dir) / f) for f in ("d2t.npy", "t2d.npy")]
    return sha256_json(
        {"shards": shard_ids, "vocab": vocab, "target": quick_identity(target_path), "cfg": cfg, "seed": seed, "max_seq_len": max_seq_len}
    )


def _fault_after_step(step: int) -> None:
    """Test hook: ``EAGLE3_FAULT_KILL_AFTER_STEPS=K`` SIGKILLs the process once the checkpoint after step K is saved."""
    if os.environ.get("EAGLE3_FAULT_KILL_AFTER_STEPS") == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def train(
    shards: list[str],
    vocab_dir: str,
    target_path: str,
    out_dir: str,
    metrics_path: str,
    cfg: dict,
    *,
    seed: int,
    max_seq_len: int,
    trust_remote_code: bool = False,
    summary_path: str | None = None,
    step_callback: Callable[[int, int], None] | None = None,
) -> dict:
    """Train a drafter and write it (speculators format) to ``out_dir``.

    Args:
        shards: hidden-state shard paths (:mod:`eagle3_pipeline.hidden_states` format).
        vocab_dir: directory with ``d2t.npy`` and ``t2d.npy``.
        target_path: the target model directory (verifier).
        out_dir: checkpoint directory to write (atomically renamed into place).
        metrics_path: JSONL file, one line per logged step plus validation lines.
        cfg: validated ``training:`` config.
        seed: RNG seed (model init, packing order).
        max_seq_len: the pipeline's sequence limit in tokens; packs hold
            ``max(cfg["pack_tokens"], max_seq_len)`` tokens so no sample is cut.
        trust_remote_code: allow the target's own config code.
        summary_path: where the caller writes the returned summary: when it, ``out_dir`` and
            ``metrics_path`` exist and it names this training's ``fingerprint`` (inputs and
            settings), another job of these outputs finished them (one that outlived its
            snakemake, waited for under :func:`eagle3_pipeline.hygiene.output_lock`), and that
            summary is returned without training again.
        step_callback: called on every rank after each optimizer step with the step number and
            the tokens seen so far over all ranks (``benchmarks/train_profile.py`` steps
            ``torch.profiler`` with it). The parts of a step are labelled for a profiler by
            :data:`STEP_PHASES`.

    Returns:
        a summary dict (steps, tokens seen, tokens/s, final validation metrics, ``fingerprint``).
        ``tokens_per_second`` is over this run's whole training loop (validation and
        checkpoints included); ``steady_tokens_per_second`` over the optimizer steps after the
        first 10% of this run's (compilation happens there), without the ``validation_seconds``
        and ``checkpoint_seconds`` spent between them.

    Raises:
        InputError: shards disagree on layer ids, ``cfg["aux_layer_ids"]`` are not stored
            in them, or a shard has no supervised tokens.
    """
    from speculators.losses import resolve_loss_config
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from speculators.train.optimizers import build_optimizers
    from transformers import get_scheduler

    torch.manual_seed(seed)
    ctx = init_distributed(cfg["device"], cfg["parallelism"])
    device = ctx.device
    world, accum = ctx.world_size, cfg["gradient_accumulation_steps"]
    per_step = world * accum
    # first: the shards' bytes against their indexes (an altered shard stops here, before any work)
    # runtime settings (loader workers, checkpoint interval: x-result false) change no weights
    result_cfg = {k: v for k, v in cfg.items() if k not in runtime_keys("training")}
    fingerprint = _train_fingerprint(shards, vocab_dir, target_path, {**result_cfg, "world_size": world}, seed, max_seq_len)
    if summary_path is not None:
        if ctx.rank == 0:  # outputs a killed snakemake's job finished, kept by the rerun's start (shard_job.keep_for_rerun)
            take_back_kept(
                [out_dir, metrics_path], summary_path, fingerprint, functools.partial(check_recorded_files, out_dir, exhaustive=True)
            )
        _barrier(ctx)
        done = finished_by_another_job(summary_path, [out_dir, metrics_path], fingerprint)
        if done is not None:
            return done
    readers = [ShardReader(p) for p in shards]
    layer_ids = readers[0].layer_ids
    for r in readers:
        if r.layer_ids != layer_ids:
            raise InputError(f"{r.path}: layer ids {r.layer_ids} differ from {readers[0].path}: {layer_ids}; re-extract all shards")
        if not bool(r.loss_mask.any()):
            raise InputError(f"{r.path}: no supervised tokens (loss mask is all zero)")
    try:
        aux, aux_columns = drafter_aux_columns(cfg.get("aux_layer_ids"), readers[0].aux_layer_ids)
    except ValueError as e:
        raise InputError(f"training.aux_layer_ids: {e} ({readers[0].path})") from None
    d2t, t2d = load_mapping(vocab_dir)

    hs_dtype, autocast = training_dtypes(cfg, device)
    total_seq_len = max(cfg["pack_tokens"], max_seq_len)
    base = build_drafter(target_path, d2t, t2d, aux, {**cfg, "max_seq_len_hint": total_seq_len}, device, trust_remote_code)
    hidden_size = base.hidden_size

    train_items, val_items = split_items(readers, cfg["val_fraction"], cfg.get("max_train_samples"))
    train_items, loss_end, loops = looping_answers(readers, train_items, cfg["looping_answers"])
    if loops["found"]:
        logger.info(
            "training: %d of %d training answers end in a repetition loop (looping_answers: %s; %d trimmed, %d dropped)",
            loops["found"],
            len(train_items) + loops["dropped"],
            loops["mode"],
            loops["trimmed"],
            loops["dropped"],
        )
    if not train_items:
        raise InputError("training.looping_answers: drop left no training answer (every one ends in a repetition loop); use trim or keep")
    train_ds = ShardDataset(readers, train_items, total_seq_len, hs_dtype, aux_columns, loss_end)
    val_ds = ShardDataset(readers, val_items, total_seq_len, hs_dtype, aux_columns) if val_items else None
    train_loader = _loader(train_ds, total_seq_len, hidden_size, len(aux), seed)
    val_loader = _loader(val_ds, total_seq_len, hidden_size, len(aux), seed) if val_ds else None

    # Every rank builds the same pack list (same seed); optimizer step s of an epoch uses
    # packs [s*W*A, (s+1)*W*A): rank r's micro-batch a is pack s*W*A + a*W + r. So W ranks
    # x A accumulation steps see exactly the packs of 1 rank x W*A accumulation steps.
    # The number of packs varies a little from epoch to epoch (packing follows the
    # shuffled order); len(train_loader), speculators' estimate, sizes the schedule.
    steps_per_epoch = len(train_loader) // per_step
    if steps_per_epoch == 0:
        raise InputError(
            f"{len(train_loader)} packed batches per epoch are fewer than train_gpus x gradient_accumulation_steps = {per_step}; "
            "lower them or training.pack_tokens, or add data"
        )
    total_steps = steps_per_epoch * cfg["epochs"]
    if cfg["max_steps"]:
        total_steps = min(total_steps, cfg["max_steps"])
    model = _wrap(base, ctx, hs_dtype)
    optimizers = build_optimizers(model, _optimizer_config(cfg))
    warmup = math.ceil(cfg["warmup_fraction"] * total_steps)
    schedulers = [get_scheduler(cfg["scheduler"], opt, num_warmup_steps=warmup, num_training_steps=total_steps) for opt in optimizers]
    loss_impl = cfg["loss_implementation"]
    if loss_impl == "auto":
        # speculators' fused (Triton) loss fails inside its torch.compile'd forward with
        # torch 2.11 ("ListVariable ... is already tracked for mutation", H200, 2026-11-30,
        # benchmarks/gpu_smoke.py --loss-implementation fused); eager works on CPU and GPU.
        loss_impl = "eager"
    call_kwargs = {
        "ttt_steps": cfg["ttt_steps"],
        "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
        "loss_config": resolve_loss_config(cfg["loss"], loss_impl),
    }
    eval_model = model.module if ctx.parallelism == "ddp" else model

    logger.info(
        "training: %d train / %d val samples, up to %d steps (%d/epoch x %d epochs: the schedule's estimate; each epoch packs "
        "its shuffled samples anew and may fill a step fewer), pack %d tokens, %d process(es) x %d accumulation (%s), device %s, "
        "aux layers %s, draft vocab %d",
        len(train_items),
        len(val_items),
        total_steps,
        steps_per_epoch,
        cfg["epochs"],
        total_seq_len,
        world,
        accum,
        ctx.parallelism,
        device,
        aux,
        d2t.shape[0],
    )
    ckpt = TrainCheckpoint(
        checkpoint_beside(metrics_path),
        # loader processes do not change the batches: a resume may use another number
        fingerprint,
    )
    state = ckpt.load()
    step, tokens_seen, start_epoch, start_batch = 0, 0, 0, 0
    lines: list[dict] = []
    if state is not None:
        _load_full_state(model, optimizers, state, ctx)
        for sch, sd in zip(schedulers, state["schedulers"], strict=True):
            sch.load_state_dict(sd)
        torch.set_rng_state(state["rng"])
        step, tokens_seen, start_epoch, start_batch, lines = (
            state["step"],
            state["tokens_seen"],
            state["epoch"],
            state["batch"],
            state["metrics"],
        )
        logger.info(
            "resuming training from its checkpoint at step %d/%d (epoch %d, batch %d, %d tokens seen)",
            step,
            total_steps,
            start_epoch,
            start_batch,
            tokens_seen,
        )
    tokens_at_start = tokens_seen
    # training seconds of earlier attempts, up to their last checkpoint (work after it was redone)
    seconds_before = float(state.get("seconds_done", 0.0)) if state is not None else 0.0
    timer = Timer()
    # Steady-state rate: from the end of the first 10% of this run's steps (compilation of
    # the attention kernels and first allocations happen there) to the end.
    warm_step = step + max(1, (total_steps - step) // 10)
    warm_mark: tuple[float, int] | None = None
    # Seconds outside the optimizer steps (validation, checkpoints), in all and after warm_mark:
    # the steady rate is the steps' own, as speculators' per-step ``step_ms`` is (the 8B shape's
    # figure of benchmarks/vs_speculators.py counted its epoch's validation pass in).
    off_steps = {"validation": 0.0, "checkpoints": 0.0, "after_warm_up": 0.0}

    @contextlib.contextmanager
    def outside_steps(kind: str):
        t0 = timer.seconds
        try:
            yield
        finally:
            dt = timer.seconds - t0
            off_steps[kind] += dt
            if warm_mark is not None:
                off_steps["after_warm_up"] += dt

    last_train: dict = next((x for x in reversed(lines) if x["split"] == "train"), {})
    val_metrics: dict = next((x for x in reversed(lines) if x["split"] == "val"), {})
    last_train = {k: v for k, v in last_train.items() if k not in ("split", "step", "epoch", "tokens", "seconds", "lr")}
    val_metrics = {k: v for k, v in val_metrics.items() if k not in ("split", "step", "epoch")}
    sampler = train_loader.batch_sampler
    collate = train_loader.collate_fn
    every = cfg["checkpoint_every_steps"]
    workers = loader_workers(cfg, device)

    def snapshot(epoch: int, batch: int) -> None:
        model_sd, opt_sds = _full_state(model, optimizers, ctx)
        if ctx.rank == 0:
            ckpt.save(
                {
                    "model": model_sd,
                    "optimizers": opt_sds,
                    "schedulers": [s.state_dict() for s in schedulers],
                    "rng": torch.get_rng_state(),
                    "step": step,
                    "total_steps": total_steps,
                    "tokens_seen": tokens_seen,
                    "epoch": epoch,
                    "batch": batch,
                    "metrics": lines,
                    "seconds_done": seconds_before + timer.seconds,
                }
            )
            logger.info("checkpoint at step %d/%d saved in %s: a rerun resumes from here", step, total_steps, ckpt.dir)
        _barrier(ctx)
        _fault_after_step(step)

    model.train()
    bar = progress(total=total_steps, initial=step, desc="train", unit="step", disable=ctx.rank != 0)
    for epoch in range(start_epoch, cfg["epochs"]):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)
        batches = list(sampler)
        epoch_steps = len(batches) // per_step
        if len(batches) > epoch_steps * per_step:
            logger.info(
                "epoch %d: %d of %d packs do not fill a step of %d packs and are left out",
                epoch,
                len(batches) % per_step,
                len(batches),
                per_step,
            )
        first = start_batch if epoch == start_epoch else 0  # steps done before a restart are skipped
        last = min(epoch_steps, first + total_steps - step)
        # this rank's micro-batches of the epoch's remaining steps, read ahead by loader workers
        mine = micro_batches(
            train_ds,
            collate,
            [batches[si * per_step + a * world + ctx.rank] for si in range(first, last) for a in range(accum)],
            workers=workers,
            pin_memory=device.startswith("cuda"),
        )
        for si in range(first, last):
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=device))
            for a in range(accum):
                with record_function(STEP_PHASES["load"]):
                    host = next(mine)
                sums["tokens"] = sums["tokens"] + float((host["document_ids"] != -1).sum())
                with record_function(STEP_PHASES["h2d"]):
                    b = _batch_to(host, device)
                sync = contextlib.nullcontext() if ctx.parallelism != "ddp" or a == accum - 1 else model.no_sync()
                with sync:
                    amp = torch.autocast(device.split(":")[0], dtype=autocast, enabled=autocast is not None)
                    with record_function(STEP_PHASES["forward"]), amp:
                        _, loss, metrics = model(**b, **call_kwargs)
                    with record_function(STEP_PHASES["backward"]):
                        (loss / accum).backward()
                for k, v in metrics.items():
                    sums[k] = sums[k] + v.detach().float()
            with record_function(STEP_PHASES["optimizer"]):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for opt in optimizers:
                    opt.step()
                for sch in schedulers:
                    sch.step()
            step += 1
            with record_function(STEP_PHASES["metrics"]):
                reduced = ctx.all_reduce_sum(sums)
            tokens_seen += int(reduced.pop("tokens"))
            last_train = _step_metrics(reduced, per_step)
            if step % cfg["log_every_steps"] == 0 or step == total_steps:
                lines.append(
                    {
                        "split": "train",
                        "step": step,
                        "epoch": epoch,
                        "tokens": tokens_seen,
                        "seconds": round(timer.seconds, 3),
                        "lr": schedulers[0].get_last_lr()[0],
                        **last_train,
                    }
                )
                logger.info(
                    "step %d/%d loss %.4f (summed over %d TTT steps) acc0 %.3f tok/s %.0f",
                    step,
                    total_steps,
                    last_train.get("loss", float("nan")),
                    cfg["ttt_steps"],
                    last_train.get("full_acc_0", float("nan")),
                    (tokens_seen - tokens_at_start) / max(timer.seconds, 1e-9),
                )
            bar.update(1)
            if step_callback is not None:
                step_callback(step, tokens_seen)
            if step == warm_step:
                warm_mark = (timer.seconds, tokens_seen)
            if every and step % every == 0 and step < total_steps and si + 1 < epoch_steps:
                with outside_steps("checkpoints"):
                    snapshot(epoch, si + 1)
        mine = None  # ends the epoch's loader workers
        if val_loader is not None:
            with outside_steps("validation"):
                val_metrics = evaluate_offline(eval_model, val_loader, call_kwargs, device, autocast, d2t)
            lines.append({"split": "val", "step": step, "epoch": epoch, **val_metrics})
            logger.info("epoch %d validation: %s", epoch, {k: round(v, 4) for k, v in val_metrics.items()})
        if step < total_steps:
            with outside_steps("checkpoints"):
                snapshot(epoch + 1, 0)
    if bar.total and bar.n < bar.total:  # the last epoch packed fewer batches than the schedule's estimate
        bar.total = bar.n
        bar.refresh()
    bar.close()
    train_seconds = timer.seconds
    steady_seconds = train_seconds - warm_mark[0] - off_steps["after_warm_up"] if warm_mark else 0.0

    save_dtype = getattr(torch, cfg["save_dtype"])
    model_sd, _ = _full_state(model, [], ctx)
    if ctx.rank == 0:
        with atomic_dir(out_dir) as tmp:
            base.save_pretrained(tmp, state_dict=convert_float_dtype(model_sd, save_dtype))
            patch_config_dtype(tmp / "config.json", save_dtype)
        record_files(out_dir)  # what evaluation checks before vLLM loads it (io.check_recorded_files)
        write_text_atomic(metrics_path, "".join(json.dumps(x) + "\n" for x in lines))
        ckpt.remove()
    _barrier(ctx)
    return {
        "steps": step,
        "epochs": cfg["epochs"],
        "train_samples": len(train_items),
        "val_samples": len(val_items),
        "tokens_seen": tokens_seen,
        "seconds": round(train_seconds, 3),
        "total_seconds": round(seconds_before + train_seconds, 3),
        "tokens_per_second": (tokens_seen - tokens_at_start) / train_seconds if train_seconds else 0.0,
        "warmup_seconds": round(warm_mark[0], 3) if warm_mark else None,
        "steady_tokens_per_second": (tokens_seen - warm_mark[1]) / steady_seconds
        if steady_seconds > 0 and warm_mark and tokens_seen > warm_mark[1]
        else None,
        "validation_seconds": round(off_steps["validation"], 3),
        "checkpoint_seconds": round(off_steps["checkpoints"], 3),
        "resumed_from_step": state["step"] if state is not None else None,
        "fingerprint": fingerprint,
        "device": device,
        "hidden_states_dtype": str(hs_dtype).removeprefix("torch."),
        "autocast": str(autocast).removeprefix("torch.") if autocast is not None else "none",
        "world_size": world,
        "parallelism": ctx.parallelism,
        "gradient_accumulation_steps": accum,
        "aux_layer_ids": aux,
        "draft_vocab_size": int(d2t.shape[0]),
        "ttt_steps": cfg["ttt_steps"],
        "looping_answers": loops,
        "final_train": last_train,
        "final_val": val_metrics,
    }


def run_training(args: dict, num_processes: int) -> dict:
    """Train in this process (``num_processes`` ≤ 1) or under ``torchrun`` with that many processes.

    ``args`` are :func:`train`'s keyword arguments (JSON-serialisable). With several
    processes this runs ``python -m torch.distributed.run --standalone --nproc-per-node N
    -m eagle3_pipeline.training <args.json>``; every rank's output goes to this
    process's stdout/stderr (the job log), rank 0 writes the outputs and the summary.

    Returns:
        :func:`train`'s summary.

    Raises:
        RuntimeError: fewer GPUs visible than processes asked for (training on CUDA), or
            torchrun exited non-zero (a rank failed; its traceback is in the log).
    """
    if num_processes <= 1:
        return train(**args)
    if resolve_device(args["cfg"]["device"]).startswith("cuda") and torch.cuda.device_count() < num_processes:
        raise RuntimeError(
            f"resources.train_gpus={num_processes} but this job sees {torch.cuda.device_count()} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower it or give the job more GPUs"
        )
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="eagle3-train-") as tmp:
        args_path = Path(tmp) / "args.json"
        summary_path = Path(tmp) / "summary.json"
        args_path.write_text(json.dumps({"args": args, "summary": str(summary_path)}))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={num_processes}",
            "-m",
            "eagle3_pipeline.training",
            str(args_path),
        ]
        logger.info("starting %d training processes: %s", num_processes, " ".join(cmd))
        sys.stdout.flush()
        sys.stderr.flush()
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            raise RuntimeError(f"distributed training failed (torchrun exit code {rc}); the failing rank's traceback is above")
        return json.loads(summary_path.read_text())


def _torchrun_main(args_path: str) -> None:
    """Entry point of each torchrun process (see :func:`run_training`)."""
    from .runtime import start_log

    start_log(None)
    spec = json.loads(Path(args_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    summary = train(**spec["args"])
    if rank == 0:
        write_text_atomic(spec["summary"], json.dumps(summary))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _torchrun_main(sys.argv[1])

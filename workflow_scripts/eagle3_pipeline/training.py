"""train_drafter: train speculators' ``Eagle3DraftModel`` from hidden-state shards.

Everything model-side is speculators' own: the draft decoder config
(``create_transformer_layer_config``), the model (``Eagle3DraftModel.from_training_args``,
which loads the target's embeddings, final norm and the draft-vocab rows of its
``lm_head``), the token shift (``shift_batch``), packing (``MultipackDistributedBatchSamplerV2``
+ ``CollateFn``), the loss (``resolve_loss_config``) and metrics, the optimizers
(``build_optimizers``) and checkpoint dtype handling. This module only feeds it our
shards and runs the loop, because ``speculators train`` refuses to run without an
accelerator and reads a different on-disk format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .hidden_states import ShardReader
from .io import InputError, atomic_dir, sha256_file, sha256_json, write_text_atomic
from .runtime import Timer, progress

logger = logging.getLogger(__name__)


def _base_dataset():
    from speculators.train.data import BaseDataset

    return BaseDataset


class ShardDataset(_base_dataset()):  # type: ignore[misc]
    """speculators training samples read from hidden-state shards.

    Each item is speculators' unshifted sample dict: ``hidden_states``
    ``[T, A*H]`` (aux layers concatenated in ``aux_layer_ids`` order),
    ``verifier_last_hidden_states`` ``[T, H]`` (final layer, pre-norm), ``input_ids``
    int64 ``[T]``, ``loss_mask`` bool ``[T]`` (+ ``lengths``, ``position_ids`` added by
    ``BaseDataset``).
    """

    def __init__(self, readers: list[ShardReader], items: list[tuple[int, int]], max_len: int, hidden_states_dtype: torch.dtype):
        self.readers = readers
        self.items = items
        super().__init__(max_len=max_len, hidden_states_dtype=hidden_states_dtype)

    def __len__(self) -> int:
        return len(self.items)

    def _compute_approx_lengths(self) -> list[int]:
        lens = [r.lengths() for r in self.readers]
        return [lens[s][i] for s, i in self.items]

    def _get_raw_data(self, index: int) -> dict:
        s, i = self.items[index]
        smp = self.readers[s].sample(i)
        hs = smp["hidden_states"]  # [T, L, H]
        t, n_layers, h = hs.shape
        return {
            "hidden_states": hs[:, : n_layers - 1].reshape(t, (n_layers - 1) * h).to(self.hidden_states_dtype),
            "verifier_last_hidden_states": hs[:, n_layers - 1].to(self.hidden_states_dtype),
            "input_ids": smp["input_ids"].long(),
            "loss_mask": smp["loss_mask"].bool(),
        }


def split_items(readers: list[ShardReader], val_fraction: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split samples into train/validation by a hash of their id: deterministic.

    A sample is validation when the first 8 bytes of ``sha256("val:" + id)``, read as a
    fraction of 2**64, fall below ``val_fraction``. The id itself is not used directly:
    ``prompts.max_prompts`` keeps the lowest ids, which would all land on one side.
    At least one sample stays in training.
    """
    train, val = [], []
    for s, r in enumerate(readers):
        for i, sid in enumerate(r.sample_ids):
            u = int.from_bytes(hashlib.sha256(f"val:{sid}".encode()).digest()[:8], "big") / 2**64
            (val if u < val_fraction else train).append((s, i))
    if not train:
        train, val = val[:1], val[1:]
    return train, val


def resolve_device(device: str) -> str:
    """``"auto"`` → ``"cuda"`` when available, else ``"cpu"``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_drafter(
    target_path: str, d2t: np.ndarray, t2d: np.ndarray, aux_layer_ids: list[int], cfg: dict, device: str, trust_remote_code: bool = False
):
    """The ``Eagle3DraftModel`` to train, by speculators' own builders.

    Fresh: the draft decoder is a Llama layer stack shaped after the target
    (``create_transformer_layer_config``) with ``cfg["draft_layers"]`` layers, all with
    full attention (vLLM honours it; no sliding window to mismatch); embeddings, final
    norm and the draft-vocab rows of ``lm_head`` come from the target.

    Warm start (``cfg["init_from"]``): the earlier drafter's weights and config, with
    its verifier re-pointed at ``target_path``.

    Raises:
        InputError: the warm-start drafter's aux layer ids or draft vocab differ from
            this run's (re-extract with its layer ids, or start fresh).
    """
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.train.cli import create_transformer_layer_config

    attn = cfg["attn_implementation"]
    if attn == "auto":
        attn = "simple_flex_attention" if device.startswith("cuda") else "sdpa"
    if cfg.get("init_from"):
        config = Eagle3SpeculatorConfig.from_pretrained(cfg["init_from"])
        if list(config.eagle_aux_hidden_state_layer_ids or []) != list(aux_layer_ids):
            raise InputError(
                f"training.init_from={cfg['init_from']} uses aux layer ids {config.eagle_aux_hidden_state_layer_ids}, "
                f"the hidden states have {list(aux_layer_ids)}; set extraction.aux_layer_ids to match"
            )
        if config.draft_vocab_size != d2t.shape[0]:
            raise InputError(f"training.init_from={cfg['init_from']} has draft vocab {config.draft_vocab_size}, this run {d2t.shape[0]}")
        config.transformer_layer_config._attn_implementation = attn
        config.speculators_config.verifier.name_or_path = target_path
        model = Eagle3DraftModel.from_pretrained(cfg["init_from"], config=config, t2d=torch.from_numpy(t2d), d2t=torch.from_numpy(d2t))
        return model.to(device=device, dtype=torch.float32)

    n = cfg["draft_layers"]
    tl_config = create_transformer_layer_config(
        verifier_name_or_path=target_path,
        num_layers=n,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=cfg["max_seq_len_hint"],
        full_attention_indices=list(range(n)),
        trust_remote_code=trust_remote_code,
    )
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


def _step_metrics(metrics: dict) -> dict:
    from speculators.train.utils import normalize_counted_metrics

    return normalize_counted_metrics({k: float(v) for k, v in metrics.items()})


def _batch_to(batch: dict, device: str) -> dict:
    keep = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    return {k: batch[k].to(device) for k in keep}


def evaluate_offline(model, loader, call_kwargs: dict, device: str, autocast_dtype) -> dict:
    """Validation metrics (loss, per-position full/conditional accuracy), token-weighted sums."""
    model.eval()
    sums: dict[str, float] = defaultdict(float)
    with torch.no_grad():
        for batch in loader:
            with torch.autocast(device.split(":")[0], dtype=autocast_dtype, enabled=autocast_dtype is not None):
                _, _, metrics = model(**_batch_to(batch, device), **call_kwargs)
            for k, v in metrics.items():
                sums[k] += float(v)
    model.train()
    return _step_metrics(dict(sums)) if sums else {}


class TrainCheckpoint:
    """The training state of an unfinished run, saved atomically to resume after a kill.

    Holds model, optimizer and scheduler states, step, position in the epoch, RNG state
    and the metrics so far (``torch.save`` of a dict), under a fingerprint of the run's
    inputs and settings; a checkpoint with another fingerprint is ignored and replaced.
    """

    def __init__(self, directory: Path, fingerprint: str):
        self.dir = directory
        self.fingerprint = fingerprint

    def load(self) -> dict | None:
        path = self.dir / "state.pt"
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=False)
        if state.get("fingerprint") != self.fingerprint:
            logger.warning("ignoring the training checkpoint in %s: inputs or settings changed", self.dir)
            return None
        return state

    def save(self, state: dict) -> None:
        with atomic_dir(self.dir) as tmp:
            torch.save({**state, "fingerprint": self.fingerprint}, tmp / "state.pt")

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _train_fingerprint(shards: list[str], vocab_dir: str, target_path: str, cfg: dict, seed: int, max_seq_len: int) -> str:
    """Identity of a training run: shard checksums (from their manifests), vocab, target, settings."""
    from .target_model import quick_identity

    shard_ids = []
    for p in shards:
        index = Path(p).with_name(Path(p).name.replace(".safetensors", ".index.json"))
        shard_ids.append(json.loads(index.read_text())["sha256"] if index.is_file() else sha256_file(p))
    vocab = [sha256_file(Path(vocab_dir) / f) for f in ("d2t.npy", "t2d.npy")]
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

    Returns:
        a summary dict (steps, tokens seen, tokens/s, final validation metrics).

    Raises:
        InputError: shards disagree on layer ids, or a shard has no supervised tokens.
    """
    from speculators.losses import resolve_loss_config
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from speculators.train.optimizers import build_optimizers
    from transformers import get_scheduler

    torch.manual_seed(seed)
    device = resolve_device(cfg["device"])
    readers = [ShardReader(p) for p in shards]
    layer_ids = readers[0].layer_ids
    for r in readers:
        if r.layer_ids != layer_ids:
            raise InputError(f"{r.path}: layer ids {r.layer_ids} differ from {readers[0].path}: {layer_ids}; re-extract all shards")
        if not bool(r.loss_mask.any()):
            raise InputError(f"{r.path}: no supervised tokens (loss mask is all zero)")
    aux = readers[0].aux_layer_ids
    d2t = np.load(Path(vocab_dir) / "d2t.npy")
    t2d = np.load(Path(vocab_dir) / "t2d.npy")

    hs_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["hidden_states_dtype"]]
    autocast = {"bfloat16": torch.bfloat16, "none": None}[cfg["autocast"]]
    total_seq_len = max(cfg["pack_tokens"], max_seq_len)
    model = build_drafter(target_path, d2t, t2d, aux, {**cfg, "max_seq_len_hint": total_seq_len}, device, trust_remote_code)
    hidden_size = model.hidden_size

    train_items, val_items = split_items(readers, cfg["val_fraction"])
    train_ds = ShardDataset(readers, train_items, total_seq_len, hs_dtype)
    val_ds = ShardDataset(readers, val_items, total_seq_len, hs_dtype) if val_items else None
    train_loader = _loader(train_ds, total_seq_len, hidden_size, len(aux), seed)
    val_loader = _loader(val_ds, total_seq_len, hidden_size, len(aux), seed) if val_ds else None

    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * cfg["epochs"]
    if cfg["max_steps"]:
        total_steps = min(total_steps, cfg["max_steps"])
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

    logger.info(
        "training: %d train / %d val samples, %d steps (%d/epoch x %d epochs), pack %d tokens, device %s, aux layers %s, draft vocab %d",
        len(train_items),
        len(val_items),
        total_steps,
        steps_per_epoch,
        cfg["epochs"],
        total_seq_len,
        device,
        aux,
        d2t.shape[0],
    )
    ckpt = TrainCheckpoint(
        Path(metrics_path).parent / ".checkpoint", _train_fingerprint(shards, vocab_dir, target_path, cfg, seed, max_seq_len)
    )
    state = ckpt.load()
    step, tokens_seen, start_epoch, start_batch = 0, 0, 0, 0
    lines: list[dict] = []
    if state is not None:
        model.load_state_dict(state["model"])
        for opt, sd in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(sd)
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
    timer = Timer()
    last_train: dict = next((x for x in reversed(lines) if x["split"] == "train"), {})
    val_metrics: dict = next((x for x in reversed(lines) if x["split"] == "val"), {})
    last_train = {k: v for k, v in last_train.items() if k not in ("split", "step", "epoch", "tokens", "seconds", "lr")}
    val_metrics = {k: v for k, v in val_metrics.items() if k not in ("split", "step", "epoch")}
    sampler = train_loader.batch_sampler
    collate = train_loader.collate_fn
    every = cfg["checkpoint_every_steps"]

    def snapshot(epoch: int, batch: int) -> None:
        ckpt.save(
            {
                "model": model.state_dict(),
                "optimizers": [o.state_dict() for o in optimizers],
                "schedulers": [s.state_dict() for s in schedulers],
                "rng": torch.get_rng_state(),
                "step": step,
                "tokens_seen": tokens_seen,
                "epoch": epoch,
                "batch": batch,
                "metrics": lines,
            }
        )

    model.train()
    bar = progress(total=total_steps, initial=step, desc="train", unit="step")
    for epoch in range(start_epoch, cfg["epochs"]):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)
        batches = list(sampler)
        for bi, idxs in enumerate(batches):
            if epoch == start_epoch and bi < start_batch:
                continue  # done before the restart
            if step >= total_steps:
                break
            b = _batch_to(collate([train_ds[i] for i in idxs]), device)
            with torch.autocast(device.split(":")[0], dtype=autocast, enabled=autocast is not None):
                _, loss, metrics = model(**b, **call_kwargs)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in optimizers:
                opt.step()
            for sch in schedulers:
                sch.step()
            tokens_seen += int((b["document_ids"] != -1).sum())
            step += 1
            last_train = _step_metrics(metrics)
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
                    "step %d/%d loss %.4f acc0 %.3f tok/s %.0f",
                    step,
                    total_steps,
                    last_train.get("loss", float("nan")),
                    last_train.get("full_acc_0", float("nan")),
                    (tokens_seen - tokens_at_start) / max(timer.seconds, 1e-9),
                )
            bar.update(1)
            if every and step % every == 0 and step < total_steps and bi + 1 < len(batches):
                snapshot(epoch, bi + 1)
                _fault_after_step(step)
        if val_loader is not None:
            val_metrics = evaluate_offline(model, val_loader, call_kwargs, device, autocast)
            lines.append({"split": "val", "step": step, "epoch": epoch, **val_metrics})
            logger.info("epoch %d validation: %s", epoch, {k: round(v, 4) for k, v in val_metrics.items()})
        if step < total_steps:
            snapshot(epoch + 1, 0)
            _fault_after_step(step)
    bar.close()
    train_seconds = timer.seconds

    save_dtype = getattr(torch, cfg["save_dtype"])
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=convert_float_dtype(model.state_dict(), save_dtype))
        patch_config_dtype(tmp / "config.json", save_dtype)
    write_text_atomic(metrics_path, "".join(json.dumps(x) + "\n" for x in lines))
    ckpt.remove()
    return {
        "steps": step,
        "epochs": cfg["epochs"],
        "train_samples": len(train_items),
        "val_samples": len(val_items),
        "tokens_seen": tokens_seen,
        "seconds": round(train_seconds, 3),
        "tokens_per_second": (tokens_seen - tokens_at_start) / train_seconds if train_seconds else 0.0,
        "resumed_from_step": state["step"] if state is not None else None,
        "device": device,
        "aux_layer_ids": aux,
        "draft_vocab_size": int(d2t.shape[0]),
        "ttt_steps": cfg["ttt_steps"],
        "final_train": last_train,
        "final_val": val_metrics,
    }

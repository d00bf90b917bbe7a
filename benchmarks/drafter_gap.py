"""Where a drafter's accuracy goes between training and vLLM: the gap decomposed, row by row.

A finished run's drafter (or ``--variant``'s) is measured on the same prompts and tokens in
several ways, each row τ and acceptance per draft position at ``k``:

* ``offline/validation``: its validation samples (training's own split, the stored states),
  speculators' token-weighted ``full_acc`` and the same answers replayed as vLLM decodes
  them (:mod:`eagle3_pipeline.acceptance`): whole answers, and their first
  ``evaluation.max_tokens`` tokens.
* ``vllm/validation``: vLLM with the drafter on those samples' prompts (the traces' prompt
  ids), answers as long as generation's and as the evaluation's.
* ``offline/same-tokens``: vLLM's own answers of a vLLM row, prefilled by the ``hf`` backend
  (the run's stored layers and storage dtype) and replayed: what vLLM should have measured
  on exactly the tokens it emitted, if the drafter served as it trains.
* ``vllm/eval``: the evaluation prompts with the evaluation's settings, then one engine
  setting changed at a time against an eager engine (``vllm/eager``: no CUDA graphs): k = 1,
  prefix caching flipped, batch invariance (``VLLM_BATCH_INVARIANT=1``), model runner V1 and
  V2 (``VLLM_USE_V2_MODEL_RUNNER``, GPU); and the evaluation's engine settings one request at
  a time (``vllm/one-at-a-time``).
* ``tensors``: for one request in an eager in-process engine, the aux hidden states vLLM hands
  the drafter and the drafter's logits at each draft step, against the ``hf`` backend's
  states for the same tokens and speculators' forward of the same checkpoint on them.

Each vLLM row runs in its own process and session (engine settings read from the environment
take effect; what it leaves running is stopped when it ends), a failed row is recorded with
its error and log and the rest go on, ``--out`` is rewritten after every row, and the script
exits 1 at the end when a row failed or the deadline left it out. ``--rows`` picks rows by
name prefix. The run's files the rows read (hidden states, traces, evaluation prompts, the
drafter, the target) are checked before the first row; a missing one is named with the
Snakemake command that makes it.

Run after the run itself (``make setup`` on a CPU machine, ``bash envs/gpu-host-setup.sh
<wheelhouse>`` on a GPU host; ``benchmarks/drafter_gap_h200.sh`` does both on an H200)::

    .venv/bin/python benchmarks/drafter_gap.py --configfile config/examples/smollm2-h200.yaml \\
        --prompts 200 --out benchmarks/results/drafter_gap_h200.json
    (CPU, the demo run: --configfile config/config.yaml --prompts 20)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402

# --- configuration and inputs -------------------------------------------------------------------


def load_config(configfiles: list[str], overrides: list[str]) -> dict:
    """config/config.yaml, then each file and YAML snippet merged over it as Snakemake merges
    ``--configfile`` and ``--config`` (``snakemake.utils.update_config``), validated."""
    from snakemake.utils import update_config

    from eagle3_pipeline.config import validate_config

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for f in configfiles:
        update_config(cfg, yaml.safe_load(Path(f).read_text()) or {})
    for snippet in overrides:
        update_config(cfg, yaml.safe_load(snippet) or {})
    return validate_config(cfg)


def target_dir(cfg: dict) -> str:
    """The folder of the config's target: the embedded target's (:func:`phases.embedded_target`) or ``target.path``."""
    from eagle3_pipeline.target_model import BUILTIN_TARGET

    return str(phases.embedded_target()) if cfg["target"]["path"] == BUILTIN_TARGET else cfg["target"]["path"]


def input_problems(cfg: dict, configfiles: list[str], drafter: str, extra: list[str] = ()) -> list[str]:
    """What the rows need and the run lacks: its hidden-state and trace shards, its evaluation
    prompts, ``drafter``, the target and ``extra`` workflow outputs (the workflow's outputs named
    with the Snakemake command that makes them, other folders with what to give instead)."""
    from eagle3_pipeline.layout import BUILTIN_TARGET_DIR, RunLayout, shard_ids
    from eagle3_pipeline.target_model import BUILTIN_TARGET

    layout = RunLayout(cfg["run"])
    shards = shard_ids(cfg["prompts"]["num_shards"])
    outputs = [layout.hidden_states(s) for s in shards] + [layout.traces(s) for s in shards] + [layout.eval_prompts(), *extra]
    others = {}
    if Path(drafter) == (ROOT / layout.drafter()).resolve():
        outputs.append(layout.drafter())
    else:
        others[drafter] = "give a trained drafter's folder (--drafter), or train the variant's"
    if cfg["target"]["path"] == BUILTIN_TARGET:
        outputs.append(BUILTIN_TARGET_DIR)
    else:
        others[cfg["target"]["path"]] = "the config's target.path names no model folder"
    return phases.missing_run_outputs(outputs, configfiles) + phases.missing_paths(others)


def validation_traces(run: Path, val_fraction: float, limit: int) -> list[dict]:
    """The first ``limit`` validation samples (training's split) as their trace records."""
    from eagle3_pipeline.io import read_jsonl
    from eagle3_pipeline.shards import ShardReader
    from eagle3_pipeline.training import split_items

    readers = [ShardReader(p) for p in sorted((run / "hidden_states").glob("shard-?????.safetensors"))]
    _, val = split_items(readers, val_fraction)
    ids = [readers[s].sample_ids[i] for s, i in val][:limit]
    traces = {r["id"]: r for p in sorted((run / "traces").glob("shard-?????.jsonl")) for r in read_jsonl(p)}
    return [traces[i] for i in ids]


def eval_prompt_ids(cfg: dict, run: Path, target: str) -> list[dict]:
    """The evaluation prompts as ``{"id", "prompt_token_ids"}``, rendered as evaluate_drafter renders them."""
    from eagle3_pipeline import evaluation
    from eagle3_pipeline.io import read_jsonl
    from eagle3_pipeline.target_model import load_tokenizer

    questions = list(read_jsonl(run / "eval" / "prompts.jsonl"))
    tok = load_tokenizer(target, cfg["target"]["trust_remote_code"])
    ids = evaluation.eval_prompt_ids(tok, questions, cfg["generation"]["chat_template_kwargs"])
    return [{"id": q["id"], "prompt_token_ids": p} for q, p in zip(questions, ids, strict=True)]


def one_document_batch(h: torch.Tensor, seq: list[int], block: int = 128) -> dict:
    """The drafter's training inputs for one sequence, as train_drafter's packs hold them.

    Row ``t`` of ``h`` (``[T, A·H]``, the aux states of token ``t``) is paired with token
    ``seq[t + 1]`` at position ``t + 1`` (the drafter predicts from the state before it). The
    batch is padded past the end, as speculators' collate pads a pack (document id -1), to a
    multiple of ``block`` tokens: flex attention's block mask covers whole 128-token blocks and
    rejects a shorter query ("block_mask was created for ... but got q_len=116").

    Returns:
        ``{"hidden_states" [1, P, A·H], "input_ids", "document_ids", "position_ids" int64 [1, P]}``
        with ``P = ceil((T - 1) / block) · block``, on the CPU.
    """
    import torch

    n = len(seq) - 1
    pad = -(-n // block) * block - n
    return {
        "hidden_states": torch.cat([h[:-1], h.new_zeros(pad, h.shape[1])]).unsqueeze(0),
        "input_ids": torch.tensor(list(seq[1:]) + [0] * pad).unsqueeze(0),
        "document_ids": torch.tensor([0] * n + [-1] * pad).unsqueeze(0),
        "position_ids": torch.tensor(list(range(1, n + 1)) + [0] * pad).unsqueeze(0),
    }


# --- one vLLM engine, in a process of its own ---------------------------------------------------


def engine_job(job: dict, result_path: Path) -> dict:
    """Run ``job["sets"]`` of prompts through one engine; per set, spec-decode counters and answers,
    written to ``result_path`` after each set (a job stopped at its deadline keeps its finished sets)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_pipeline.engine import build_llm, shutdown_llm
    from eagle3_pipeline.evaluation import acceptance_report, spec_decode_counters

    t0 = time.perf_counter()
    llm = build_llm(
        job["target"], job["vllm"], seed=job["seed"], max_model_len=job["max_model_len"], speculative_config=job["spec"], **job["overrides"]
    )
    out = {"load_seconds": round(time.perf_counter() - t0, 1), "sets": {}}
    for s in job["sets"]:
        params = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in s["prompts"]]
        before = spec_decode_counters(llm.get_metrics()) if job["spec"] else None
        t = time.perf_counter()
        if s.get("sequential"):
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t
        answers = [list(o.outputs[0].token_ids) for o in outs]
        row = {"prompts": len(prompts), "output_tokens": sum(map(len, answers)), "seconds": round(secs, 2), "answers": answers}
        if job["spec"]:
            after = spec_decode_counters(llm.get_metrics())
            delta = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            pp_before = before["accepted_per_position"] + [0] * (len(after["accepted_per_position"]) - len(before["accepted_per_position"]))
            delta["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], pp_before, strict=True)]
            row |= acceptance_report(delta, job["spec"]["num_speculative_tokens"])
        out["sets"][s["name"]] = row
        result_path.write_text(json.dumps(out))
    shutdown_llm(llm)
    return out


def run_subprocess(kind: str, job: dict, env: dict, work: Path, log, timeout: float | None = None) -> dict:
    """``python drafter_gap.py <kind> job.json result.json`` with ``env`` added, as a phase
    (:func:`phases.run_phase`: its own session, output in ``<work>/<name>.log``) stopped after ``timeout`` s.

    Returns:
        its result (for an engine job stopped early or failed, the sets it finished, with
        ``error`` and ``log``), or ``{"error", "log"}``; ``wall_seconds`` in both.
    """
    work.mkdir(parents=True, exist_ok=True)
    jf, rf = work / f"{job['name']}.job.json", work / f"{job['name']}.result.json"
    jf.write_text(json.dumps(job))
    rf.unlink(missing_ok=True)
    run = phases.run_phase([sys.executable, __file__, kind, str(jf), str(rf)], work / f"{job['name']}.log", timeout=timeout, env=env)
    res = json.loads(rf.read_text()) if rf.exists() else {}
    res["wall_seconds"] = round(run.seconds, 1)
    if not run.ok:
        tail = phases.log_tail(run.log, 12)
        print(f"[{job['name']}] stopped ({run.error}):\n  " + "\n  ".join(tail), file=log, flush=True)
        res["error"] = "stopped at the deadline" if run.timed_out else run.error
        res["log"] = str(run.log)
    return res


# --- tensors: what vLLM's drafter sees and computes for one request -----------------------------


def genuine_rows(ids: list[int], pos: list[int], seq: list[int], next_start: int | None) -> list[int]:
    """The rows of one drafter call that hold tokens of the request's final sequence.

    A propose call's rows hold the positions the target just verified: row ``r`` feeds the
    token after ``pos[r]`` (vLLM shifts the ids by one). Genuine rows run consecutively from
    row 0 (``pos[r] == pos[0] + r``) and end at the last accepted token, the position before
    the next call's first row. Rows past it hold rejected drafts, and vLLM 0.26 fills the rest
    of a decode call's rows with stale positions and ids (a 4-row call read ``[53, 1, 2, 3]``
    on an H200, ids copied from the prompt's start), whose ids can equal the true tokens at
    those positions: neither counts.

    Args:
        ids: int token ids of the call's rows (the step-0 forward's ``input_ids``).
        pos: int positions of the same rows.
        seq: the request's prompt + answer token ids.
        next_start: the first position of the next call that drafted (``None`` for the last).

    Returns:
        indices of the genuine rows, ``[0, ..., m - 1]`` (empty when row 0 is not one).
    """
    out: list[int] = []
    for r, (i, p) in enumerate(zip(ids, pos, strict=True)):
        if p != pos[0] + r or not 0 <= p < len(seq) - 1 or i != seq[p + 1]:
            break
        if next_start is not None and p > next_start - 1:
            break
        out.append(r)
    return out


def tensors_job(job: dict) -> dict:
    """One request through an in-process eager engine whose EAGLE-3 drafter records its inputs and logits,
    compared with the ``hf`` backend's states and speculators' forward on the same tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models import llama_eagle3

    from eagle3_pipeline.conventions import draft_to_target, loss_mask
    from eagle3_pipeline.engine import build_llm, shutdown_llm
    from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
    from eagle3_pipeline.shards import Sample
    from eagle3_pipeline.training import load_drafter, resolve_device, training_dtypes

    events: list[tuple[str, dict]] = []
    cls = llama_eagle3.Eagle3LlamaForCausalLM
    orig_combine, orig_forward, orig_logits = cls.combine_hidden_states, cls.forward, cls.compute_logits

    def combine(self, hidden_states):
        events.append(("combine", {"states": hidden_states.detach().float().cpu().clone()}))  # vLLM reuses its buffers
        return orig_combine(self, hidden_states)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        events.append(
            ("forward", {"ids": input_ids.detach().cpu().long().clone(), "pos": positions.detach().cpu().long().reshape(-1).clone()})
        )
        return orig_forward(self, input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states):
        out = orig_logits(self, hidden_states)
        events.append(("logits", {"logits": out.detach().float().cpu().clone()}))
        return out

    cls.combine_hidden_states, cls.forward, cls.compute_logits = combine, forward, compute_logits
    llm = build_llm(
        job["target"],
        job["vllm"] | {"enforce_eager": True},
        seed=job["seed"],
        max_model_len=job["max_model_len"],
        speculative_config=job["spec"],
        distributed_executor_backend="uni",
        **job["overrides"],
    )
    prompt = job["prompt"]
    answer = list(
        llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    shutdown_llm(llm)
    del llm
    cls.combine_hidden_states, cls.forward, cls.compute_logits = orig_combine, orig_forward, orig_logits
    seq = prompt + answer
    k = job["spec"]["num_speculative_tokens"]

    # the drafter's propose calls: combine, then (forward, logits) per draft step
    calls, cur = [], None
    for kind, data in events:
        if kind == "combine":
            cur = {"states": data["states"], "steps": []}
            calls.append(cur)
        elif kind == "forward" and cur is not None:
            cur["steps"].append({"ids": data["ids"], "pos": data["pos"]})
        elif kind == "logits" and cur is not None and cur["steps"]:
            cur["steps"][-1]["logits"] = data["logits"]

    # offline: hf states of the final sequence and speculators' forward (step logits via a hook on lm_head)
    device = resolve_device(job["training"]["device"])
    drafter = load_drafter(job["drafter"], job["target"], job["training"], device)
    aux = list(drafter.config.eagle_aux_hidden_state_layer_ids)
    d2t = drafter.d2t.cpu().numpy()
    n_layers = job["num_hidden_layers"]
    model = load_hf_target(job["target"], device=device)
    states = extract_hf(
        model,
        [Sample("x", np.asarray(seq), loss_mask(len(prompt), len(answer)))],
        [*aux, n_layers],
        batch_tokens=len(seq),
        storage_dtype=torch.float32,
    )[0]
    del model
    step_logits: list[torch.Tensor] = []
    hook = drafter.lm_head.register_forward_hook(lambda _m, _i, o: step_logits.append(o.detach().float().cpu()[0]))
    hs_dtype, autocast = training_dtypes(job["training"], device)
    h = states[:, : len(aux)].reshape(len(seq), -1)
    batch = {k: v.to(device) for k, v in one_document_batch(h, seq).items()}
    batch["hidden_states"] = batch["hidden_states"].to(hs_dtype)
    with torch.no_grad(), torch.autocast(device.split(":")[0], dtype=autocast, enabled=autocast is not None):
        drafter(**batch, ttt_steps=k)
    hook.remove()
    target_ids = torch.from_numpy(draft_to_target(d2t))  # draft index -> target id

    def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> float:
        """Largest |a - b| in bf16 steps at the row's largest value (2^-8 of max |b|: bf16 keeps 8 significant bits)."""
        return float((a - b).abs().max() / (b.abs().max().clamp_min(1e-12) * 2.0**-8))

    sample = []  # the first propose calls as recorded, to read how this vLLM version calls the drafter
    for call in calls[:6]:
        st = call["steps"]
        sample.append(
            {
                "rows": int(call["states"].shape[0]),
                "step0_positions": st[0]["pos"].tolist() if st else None,
                "step0_ids": st[0]["ids"].tolist() if st else None,
                "true_next_ids": [seq[p + 1] if 0 <= p + 1 < len(seq) else None for p in st[0]["pos"].tolist()] if st else None,
                "steps": len(st),
                "logits_rows": [int(x["logits"].shape[0]) if "logits" in x else None for x in st],
            }
        )
    aux_rows, aux_rel, aux_steps, worst = 0, [], [], []
    logit_rows = [{"compared": 0, "top1_agree": 0, "max_abs_diff": 0.0, "vllm_top1_right": 0, "offline_top1_right": 0} for _ in range(k)]
    starts = [int(c["steps"][0]["pos"][0]) if c["steps"] else None for c in calls]
    for ci, call in enumerate(calls):
        if not call["steps"]:
            continue
        step0 = call["steps"][0]
        ids, pos = step0["ids"], step0["pos"]
        n = min(len(ids), len(pos), call["states"].shape[0])
        next_start = next((x for x in starts[ci + 1 :] if x is not None), None)
        genuine = genuine_rows(ids[:n].tolist(), pos[:n].tolist(), seq, next_start)
        for r in genuine:
            a, b = call["states"][r], h[pos[r]]
            aux_rows += 1
            aux_rel.append(float((a - b).norm() / b.norm().clamp_min(1e-6)))
            aux_steps.append(bf16_steps(a, b))
            if aux_rel[-1] > 0.05 and len(worst) < 8:
                worst.append({"position": int(pos[r]), "row": r, "call_rows": n, "relative_rms_diff": aux_rel[-1]})
        if not genuine or "logits" not in step0:
            continue
        anchor = int(max(pos[r] for r in genuine))
        for j, st in enumerate(call["steps"][:k]):
            if "logits" not in st or anchor + 2 + j >= len(seq):
                break
            row = st["logits"][-1]
            v = row if row.shape[-1] == len(d2t) else row[target_ids]  # this request's draft logits, draft-vocab order
            o = step_logits[j][anchor]  # speculators: step j of the draft made at row `anchor`
            lr = logit_rows[j]
            lr["compared"] += 1
            lr["top1_agree"] += int(v.argmax() == o.argmax())
            lr["max_abs_diff"] = max(lr["max_abs_diff"], float((v - o).abs().max()))
            if float((v - o).abs().max()) > 0.5 and len(worst) < 16:
                worst.append(
                    {"step": j, "anchor": anchor, "genuine_rows": len(genuine), "call_rows": n, "max_abs_diff": float((v - o).abs().max())}
                )
            lr["vllm_top1_right"] += int(int(target_ids[v.argmax()]) == seq[anchor + 2 + j])
            lr["offline_top1_right"] += int(int(target_ids[o.argmax()]) == seq[anchor + 2 + j])
            if int(target_ids[v.argmax()]) != seq[anchor + 2 + j]:
                break  # later steps ran on a wrong draft in vLLM, on the true token offline: not comparable
    return {
        "prompt_tokens": len(prompt),
        "answer_tokens": len(answer),
        "propose_calls": len(calls),
        "first_calls": sample,
        "aux_states": {
            "rows_compared": aux_rows,
            "relative_rms_diff_max": max(aux_rel, default=None),
            "relative_rms_diff_mean": float(np.mean(aux_rel)) if aux_rel else None,
            "bf16_steps_max": max(aux_steps, default=None),
            "bf16_steps_median": float(np.median(aux_steps)) if aux_steps else None,
        },
        "draft_logits_per_step": logit_rows,
        "largest_differences": worst,
    }


# --- offline rows ---------------------------------------------------------------------------------


def offline_row(drafter: str, target: str, shards: list[str], ids: list[str] | None, cfg: dict, k: int, max_tokens: int | None) -> dict:
    from eagle3_pipeline.training import evaluate_checkpoint

    m = evaluate_checkpoint(
        drafter, target, shards, ids, cfg["training"], ttt_steps=k, max_seq_len=cfg["max_seq_len"], replay_max_tokens=max_tokens
    )
    return {
        "samples": m["samples"],
        "max_tokens": max_tokens,
        "tau": m.get("replay_tau"),
        "per_position": [m.get(f"replay_acc_{j}") for j in range(k)],
        "speculators_full_acc": [m.get(f"full_acc_{j}") for j in range(k)],
        "speculators_tau": 1 + sum(m.get(f"full_acc_{j}") or 0 for j in range(k)),
    }


def same_tokens_shard(
    cfg: dict, target: str, stored: list[str], prompts: list[list[int]], answers: list[list[int]], path: Path
) -> list[str]:
    """vLLM's answers prefilled by the hf backend into a shard of the run's stored layers and storage dtype."""
    import numpy as np
    import torch

    from eagle3_pipeline.conventions import loss_mask
    from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
    from eagle3_pipeline.shards import FP8, Sample, ShardReader, write_shard

    r = ShardReader(stored[0])
    samples = [
        Sample(f"s{i:05d}", np.asarray(p + a, dtype=np.int64), loss_mask(len(p), len(a)))
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
        if len(a) >= 2
    ]
    model = load_hf_target(target, device=cfg["extraction"]["device"], trust_remote_code=cfg["target"]["trust_remote_code"])
    states = extract_hf(model, samples, r.layer_ids, batch_tokens=cfg["extraction"]["batch_tokens"], storage_dtype=torch.bfloat16)
    del model
    dtype = FP8 if cfg["extraction"]["storage_dtype"] == "float8_e4m3fn" else torch.bfloat16
    write_shard(
        path, samples, states, layer_ids=r.layer_ids, aux_layer_ids=r.aux_layer_ids, index_path=None, storage_dtype=dtype, checksum=False
    )
    return [s.id for s in samples]


# --- the decomposition ----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", nargs="+", default=[str(ROOT / "config" / "config.yaml")])
    ap.add_argument("--config", nargs="*", default=[], help="YAML snippets applied last, e.g. 'vllm: {max_num_seqs: 256}'")
    ap.add_argument("--variant", help="a sweep variant's drafter instead of the run's")
    ap.add_argument("--drafter", help="this drafter directory instead of the run's (e.g. another trainer's on the run's data)")
    ap.add_argument("--prompts", type=int, default=200, help="validation prompts")
    ap.add_argument("--rows", nargs="*", help="row name prefixes to run, in this order (default: all)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "drafter_gap"))
    ap.add_argument("--deadline", type=float, help="seconds: start no row after it, stop a running vLLM row at it (a leased GPU)")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    phases.fail_fast(phases.missing_packages(["snakemake", "torch", "vllm", "speculators"]))
    import torch

    cfg = load_config(args.configfile, args.config)
    run = ROOT / "results" / cfg["run"]
    target = target_dir(cfg)
    own = run / "sweep" / args.variant if args.variant else run
    acc_path = own / "eval" / "acceptance.json"  # absent when the run stopped after training
    acc = json.loads(acc_path.read_text()) if acc_path.exists() else {}
    drafter = str((own / "drafter").resolve()) if args.variant and (own / "drafter").exists() else acc.get("drafter")
    drafter = str(Path(args.drafter).resolve()) if args.drafter else drafter or str((run / "drafter").resolve())
    phases.fail_fast(input_problems(cfg, args.configfile, drafter))
    k = acc.get("num_speculative_tokens") or cfg["evaluation"]["num_speculative_tokens"] or cfg["training"]["ttt_steps"]
    gen_len, eval_len = cfg["generation"]["max_tokens"], cfg["evaluation"]["max_tokens"]
    shards = [str(p) for p in sorted((run / "hidden_states").glob("shard-?????.safetensors"))]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    from eagle3_pipeline.engine import engine_identity
    from eagle3_pipeline.target_model import num_hidden_layers

    val = validation_traces(run, cfg["training"]["val_fraction"], args.prompts)
    evalp = eval_prompt_ids(cfg, run, target)
    vllm_cfg = cfg["vllm"] | ({} if cfg["evaluation"]["enforce_eager"] is None else {"enforce_eager": cfg["evaluation"]["enforce_eager"]})
    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
    results = phases.Results(
        args.out,
        {
            "run": cfg["run"],
            "variant": args.variant,
            "drafter": drafter,
            "k": k,
            "validation_prompts": len(val),
            "eval_prompts": len(evalp),
            "generation_max_tokens": gen_len,
            "eval_max_tokens": eval_len,
            # what the workflow's evaluation measured for this drafter (none for --drafter's)
            "evaluate_drafter": None
            if args.drafter
            else {"tau": acc.get("acceptance_length"), "per_position": acc.get("per_position_acceptance_rate")},
            "engine": engine_identity(),
            "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
            "rows": {},
            "command": " ".join(["python", *sys.argv]),
            "config": cfg,
        },
    )
    result = results.data

    started = time.perf_counter()

    def left() -> float | None:
        """Seconds to ``--deadline`` (None: no deadline)."""
        return None if not args.deadline else args.deadline - (time.perf_counter() - started)

    def want(name: str) -> bool:
        return not args.rows or any(name.startswith(p) for p in args.rows)

    def record(name: str, row: dict) -> None:
        """Record row ``name`` (a failure where it holds ``error``) and rewrite ``--out``."""
        if "error" in row:
            results.fail(name, row.pop("error"), row.pop("log", None), section="rows", **row)
        else:
            results.put(name, row, section="rows")
        short = {
            key: result["rows"][name].get(key)
            for key in ("tau", "acceptance_length", "per_position", "per_position_acceptance_rate", "error", "log")
            if key in result["rows"][name]
        }
        print(f"[{name}] {json.dumps(short)}", flush=True)

    vp = [t["prompt_token_ids"] for t in val]
    ep = [q["prompt_token_ids"] for q in evalp]
    base_job = {"target": target, "vllm": vllm_cfg, "seed": cfg["seed"], "max_model_len": cfg["max_seq_len"], "spec": spec, "overrides": {}}
    # The evaluation's own engine first; then one setting changed at a time against an eager
    # engine (cheap to start: on a GPU each CUDA-graph engine start costs a minute), which the
    # "vllm/eager" row compares with the evaluation's own.
    eager = {"enforce_eager": True}
    prefix = not vllm_cfg["enable_prefix_caching"]
    one = [("eval", ep, eval_len, False)]
    engines = [
        # name, env, vllm settings, spec k, sets
        (
            "vllm/default",
            {},
            {},
            k,
            [
                ("eval", ep, eval_len, False),
                ("validation-short", vp, eval_len, False),
                ("validation", vp, gen_len, False),
            ],
        ),
        ("vllm/one-at-a-time", {}, {}, k, [("eval", ep, eval_len, True)]),
        ("vllm/eager", {}, eager, k, one),
        ("vllm/k1", {}, eager, 1, [("eval", ep, eval_len, False), ("validation", vp, gen_len, False)]),
        (f"vllm/prefix-cache-{'on' if prefix else 'off'}", {}, eager | {"enable_prefix_caching": prefix}, k, one),
        ("vllm/batch-invariant", {"VLLM_BATCH_INVARIANT": "1"}, eager, k, one),
    ]
    if on_gpu:  # vLLM 0.26 picks model runner V2 for a dense target with eagle3 unless told
        engines += [
            ("vllm/runner-v1", {"VLLM_USE_V2_MODEL_RUNNER": "0"}, eager, k, one),
            ("vllm/runner-v2", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, eager, k, one),
        ]
    answers: dict[str, list[list[int]]] = {}
    tasks = []  # (row name, function): run in the order --rows names them, else as listed

    def engine_task(name, env, vset, kk, sets):
        def run() -> None:
            job = base_job | {
                "name": name.replace("/", "_"),
                "vllm": vllm_cfg | vset,
                "spec": spec | {"num_speculative_tokens": kk},
                "sets": [{"name": s, "prompts": p, "max_tokens": m, "sequential": seq} for s, p, m, seq in sets],
            }
            res = run_subprocess("engine", job, env, work, sys.stdout, left())
            if "error" in res:
                record(
                    name,
                    {
                        "env": env,
                        "settings": vset,
                        "k": kk,
                        "error": res["error"],
                        "log": res.get("log"),
                        "wall_seconds": res["wall_seconds"],
                    },
                )
            for s, row in res.get("sets", {}).items():
                answers[f"{name}/{s}"] = row.pop("answers")
                record(f"{name}/{s}", {"env": env, "settings": vset, "k": kk, "load_seconds": res["load_seconds"], **row})
            if name == "vllm/default" and "vllm/default/validation" in answers:
                same = sum(a == t["completion_token_ids"] for a, t in zip(answers["vllm/default/validation"], val, strict=True))
                result["validation_answers_equal_to_traces"] = {"equal": same, "of": len(val)}

        return run

    def offline_task(name, mt):
        def run() -> None:
            record(name, offline_row(drafter, target, shards, [t["id"] for t in val], cfg, k, mt))

        return run

    def same_tokens_task(name, src, prompts):
        def run() -> None:
            if src not in answers:
                record(name, {"error": f"no answers of {src} (run that row first)"})
                return
            path = work / f"same-{src.split('/')[-1]}.safetensors"
            ids = same_tokens_shard(cfg, target, shards, prompts, answers[src], path)
            record(name, offline_row(drafter, target, [str(path)], ids, cfg, k, None) | {"of": src})

        return run

    def tensors_task() -> None:
        job = base_job | {
            "name": "tensors",
            "prompt": ep[0],
            "max_tokens": 64,
            "drafter": drafter,
            "training": cfg["training"],
            "num_hidden_layers": num_hidden_layers(target),
        }
        record("tensors", run_subprocess("tensors", job, {}, work, sys.stdout, left()))

    tasks += [(e[0], engine_task(*e)) for e in engines]
    tasks += [("offline/validation", offline_task("offline/validation", None))]
    tasks += [("offline/validation-short", offline_task("offline/validation-short", eval_len))]
    for src, prompts in (("vllm/default/eval", ep), ("vllm/default/validation", vp), ("vllm/default/validation-short", vp)):
        name = "offline/same-tokens/" + src.split("/")[-1]
        tasks.append((name, same_tokens_task(name, src, prompts)))
    tasks.append(("tensors", tensors_task))
    if args.rows:
        order = lambda name: min((i for i, p in enumerate(args.rows) if name.startswith(p)), default=len(args.rows))  # noqa: E731
        tasks = sorted((t for t in tasks if want(t[0])), key=lambda t: order(t[0]))
    for name, fn in tasks:
        if args.deadline and left() <= 0:
            record(name, {"error": "not run: --deadline reached"})
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (a row's failure is recorded, the rest go on)
            traceback.print_exc()
            record(name, {"error": repr(e)})
    sys.exit(results.finish())


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in ("engine", "tensors"):
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        payload = json.loads(Path(sys.argv[2]).read_text())
        out = engine_job(payload, Path(sys.argv[3])) if sys.argv[1] == "engine" else tensors_job(payload)
        Path(sys.argv[3]).write_text(json.dumps(out))
    else:
        main()

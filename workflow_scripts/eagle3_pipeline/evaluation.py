"""evaluate_drafter: acceptance length of the drafter measured in vLLM.

vLLM serves the target with ``speculative_config={"method": "eagle3", "model": <drafter>,
"num_speculative_tokens": k}`` on held-out prompts; τ comes from vLLM's own
``spec_decode`` counters (``LLM.get_metrics()``):

* τ (mean acceptance length) = 1 + accepted tokens / drafts — each verification step
  emits the accepted draft tokens plus one token from the target
  (vLLM ``v1/spec_decode/metrics.py`` defines the same ratio);
* acceptance rate at position ``i`` = accepted at position ``i`` / drafts.

τ is not what a user buys; tokens per second are. The same job then decodes the prompts
again at each ``evaluation.speedup.concurrency`` (requests in flight), with the drafter and
with the target alone in an engine of the same settings, and reports output tokens/s of
both and their ratio (:func:`decode_throughput`, :func:`speedup_table`). :func:`run_evaluation` is
the job: host-wide lock, stale engines, the drafter's engine, then the target's alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layout import RunLayout

logger = logging.getLogger(__name__)

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counters(metrics: Iterable) -> dict:
    """Sum vLLM's spec-decode counters over engines from ``LLM.get_metrics()`` output.

    Returns:
        ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens": int,
        "accepted_per_position": list[int]}``.

    Raises:
        RuntimeError: the counters are absent (speculative decoding was not active, or
            the engine ran with ``disable_log_stats=True``).
    """
    out = {v: 0 for v in COUNTERS.values()}
    per_pos: list[int] = []
    found = False
    for m in metrics:
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
            found = True
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            per_pos += [0] * (len(vals) - len(per_pos))
            per_pos = [a + (vals[i] if i < len(vals) else 0) for i, a in enumerate(per_pos)]
    if not found:
        raise RuntimeError("vLLM reported no spec_decode counters: speculative decoding was not active")
    out["accepted_per_position"] = per_pos
    return out


def acceptance_report(counters: dict, num_speculative_tokens: int) -> dict:
    """τ and per-position acceptance from spec-decode counters.

    Raises:
        RuntimeError: no drafts were made (nothing to measure).
    """
    drafts = counters["num_drafts"]
    if drafts <= 0:
        raise RuntimeError("vLLM made no drafts: no acceptance length to report (outputs too short?)")
    acc = counters["num_accepted_tokens"]
    per_pos = counters["accepted_per_position"]
    return {
        "acceptance_length": 1.0 + acc / drafts,
        "num_speculative_tokens": num_speculative_tokens,
        "num_drafts": drafts,
        "num_draft_tokens": counters["num_draft_tokens"],
        "num_accepted_tokens": acc,
        "draft_acceptance_rate": acc / counters["num_draft_tokens"] if counters["num_draft_tokens"] else 0.0,
        "per_position_acceptance_rate": [a / drafts for a in per_pos],
        "accepted_per_position": per_pos,
    }


def eval_prompt_ids(tokenizer, questions: list[dict], chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Each question's first turn under the target's chat template, as generation renders prompts.

    Returns:
        one ``list[int]`` of prompt token ids per question.
    """
    from .generation import render_prompt_ids

    return [render_prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}], chat_template_kwargs) for q in questions]


def fit_prompts(questions: list[dict], prompts: list[list[int]], max_tokens: int, max_seq_len: int) -> tuple[list[int], list[dict]]:
    """Which evaluation prompts leave room for ``max_tokens`` answer tokens within ``max_seq_len``.

    vLLM refuses a request whose prompt and ``max_tokens`` exceed the engine's context
    ("This model's maximum context length is ..."); such prompts are counted rejects instead.

    Returns:
        ``(kept, rejects)``: indices of the prompts that fit, and one reject record
        (``source``, ``reason`` ``prompt_too_long``, ``detail`` naming both keys, ``id``) per other.
    """
    kept, rejects = [], []
    for i, (q, p) in enumerate(zip(questions, prompts, strict=True)):
        if len(p) + max_tokens <= max_seq_len:
            kept.append(i)
            continue
        rejects.append(
            {
                "source": "evaluation",
                "reason": "prompt_too_long",
                "detail": f"{len(p)} prompt tokens + evaluation.max_tokens {max_tokens} > max_seq_len {max_seq_len}; "
                "raise max_seq_len or lower evaluation.max_tokens",
                "id": q["id"],
            }
        )
    return kept, rejects


def run_eval(
    llm, questions: list[dict], prompts: list[list[int]], eval_cfg: dict, max_seq_len: int | None = None
) -> tuple[dict, list[dict], list[dict]]:
    """Generate answers to the first turn of each question and read τ from vLLM.

    ``prompts`` are the questions' prompt token ids (:func:`eval_prompt_ids`). A prompt that
    leaves no room for ``eval_cfg["max_tokens"]`` within ``max_seq_len`` is a counted reject
    (:func:`fit_prompts`), not sent.

    Returns:
        ``(report, outputs, rejects)``: the acceptance report (``num_prompts`` answered,
        ``rejected_prompts``), per answered question ``{"id", "num_prompt_tokens",
        "num_output_tokens", "text"}``, and the reject records.

    Raises:
        InputError: no prompt fits (names the keys to change).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from .generation import engine_token_counters
    from .io import InputError

    kept, rejects = fit_prompts(questions, prompts, eval_cfg["max_tokens"], max_seq_len) if max_seq_len else (list(range(len(prompts))), [])
    if rejects:
        logger.warning("%d of %d evaluation prompts are too long and not evaluated: %s", len(rejects), len(prompts), rejects[0]["detail"])
    if not kept and not rejects:
        raise InputError("no evaluation prompts to evaluate: the evaluation's prompt file holds none (evaluation.prompts)")
    if not kept:
        raise InputError(f"no evaluation prompt fits: {rejects[0]['detail']} (all {len(rejects)} prompts)")
    questions, prompts = [questions[i] for i in kept], [prompts[i] for i in kept]
    params = SamplingParams(
        temperature=eval_cfg["temperature"], max_tokens=eval_cfg["max_tokens"], output_kind=RequestOutputKind.FINAL_ONLY
    )
    # every prompt in the engine at once, as LLM.generate does; the bar counts the engine's output tokens
    outs, _ = answer_prompts(llm, prompts, params, queued=len(prompts), desc="evaluate tau", read_counters=engine_token_counters(llm))
    report = acceptance_report(spec_decode_counters(llm.get_metrics()), eval_cfg["num_speculative_tokens"])
    rows = [
        {"id": q["id"], "num_prompt_tokens": len(p), "num_output_tokens": len(o.outputs[0].token_ids), "text": o.outputs[0].text}
        for q, p, o in zip(questions, prompts, outs, strict=True)
    ]
    report["num_prompts"] = len(questions)
    report["rejected_prompts"] = len(rejects)
    report["output_tokens"] = sum(r["num_output_tokens"] for r in rows)
    return report, rows, rejects


def answer_prompts(llm, prompts: list[list[int]], params, *, queued: int, desc: str, read_counters=None) -> tuple[list, float]:
    """``llm``'s answers to ``prompts`` (token ids), ``queued`` requests in flight, with a progress bar.

    Requests are added whenever fewer than ``queued`` are unfinished
    (:func:`eagle3_pipeline.engine.feed_engine`); the bar
    (:class:`eagle3_pipeline.generation.CompletionProgress`, labelled ``desc``) counts output
    tokens: the engine's counters when ``read_counters`` is given (its reads cost a few ms every
    2 s), else those of finished answers.

    Args:
        params: ``vllm.SamplingParams`` with ``output_kind=RequestOutputKind.FINAL_ONLY``.

    Returns:
        ``(outputs, seconds)``: one ``RequestOutput`` per prompt, in order, and the wall time
        from the first request to the last answer.
    """
    import time

    from vllm.inputs import TokensPrompt

    from .engine import feed_engine
    from .generation import CompletionProgress

    eng = llm.llm_engine
    tag = f"{desc.replace(' ', '_')}-{time.monotonic_ns()}"
    outs: list = [None] * len(prompts)
    bar = CompletionProgress(len(prompts), 1, params.max_tokens, read_counters, desc=desc)

    def add(i: int) -> None:
        eng.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
        bar.added(1, prompt_tokens=len(prompts[i]))

    def done(out) -> None:
        outs[int(out.request_id.rsplit("-", 1)[1])] = out
        bar.finished([len(c.token_ids) for c in out.outputs])

    t0, complete = time.perf_counter(), False
    try:
        feed_engine(eng, range(len(prompts)), add, done, queued=queued, poll=bar.poll)
        complete = True
    finally:
        bar.close(complete)
    return outs, time.perf_counter() - t0


def decode_throughput(
    llm, prompts: list[list[int]], max_tokens: int, concurrency: int, temperature: float = 0.0, desc: str | None = None
) -> dict:
    """Output tokens per second of ``llm`` answering ``prompts`` with ``concurrency`` requests in flight
    (its bar labelled ``desc``, by default ``decode x<concurrency>``).

    Requests are added whenever fewer than ``concurrency`` are unfinished
    (:func:`answer_prompts`, whose bar reads no engine counter here: nothing but the answers
    in the timed loop), as a server with that many clients sees them; the clock runs from the
    first request to the last answer (no model load).

    Returns:
        ``{"concurrency", "requests", "output_tokens", "seconds", "output_tokens_per_second"}``
        (seconds wall time, tokens/s over all requests).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    outs, secs = answer_prompts(llm, prompts, params, queued=concurrency, desc=desc or f"decode x{concurrency}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": round(secs, 3),
        "output_tokens_per_second": tokens / secs if secs > 0 else 0.0,
    }


def throughput_runs(llm, prompts: list[list[int]], eval_cfg: dict, label: str, *, warm_up: bool = False) -> list[dict]:
    """:func:`decode_throughput` at each ``evaluation.speedup.concurrency`` on the first
    ``speedup.max_prompts`` prompts, logged as ``label``; ``[]`` when no concurrency is set.

    ``warm_up`` first decodes two short answers (a fresh engine's first steps are slower; the
    drafter's engine is warm from the τ measurement).
    """
    speed = eval_cfg["speedup"]
    if not speed["concurrency"]:
        return []
    prompts = prompts[: speed["max_prompts"]]
    if warm_up:
        decode_throughput(llm, prompts[:2], min(16, eval_cfg["max_tokens"]), 2, eval_cfg["temperature"], desc="warm-up, not timed")
    runs = [decode_throughput(llm, prompts, eval_cfg["max_tokens"], c, eval_cfg["temperature"]) for c in speed["concurrency"]]
    logger.info(
        "decoding %s: %s output tok/s at %s requests in flight",
        label,
        ", ".join(f"{r['output_tokens_per_second']:.1f}" for r in runs),
        ", ".join(str(r["concurrency"]) for r in runs),
    )
    return runs


def speedup_table(with_drafter: list[dict], without: list[dict]) -> list[dict]:
    """Per concurrency: output tokens/s with and without the drafter and their ratio (the speedup).

    Args:
        with_drafter, without: :func:`decode_throughput` results, one per concurrency, in the same order.

    Raises:
        ValueError: the two lists measure different concurrencies.
    """
    rows = []
    for w, b in zip(with_drafter, without, strict=True):
        if w["concurrency"] != b["concurrency"]:
            raise ValueError(f"concurrency {w['concurrency']} measured with the drafter, {b['concurrency']} without")
        logger.info(
            "%d in flight: %.1f output tok/s with the drafter, %.1f without",
            w["concurrency"],
            w["output_tokens_per_second"],
            b["output_tokens_per_second"],
        )
        rows.append(
            {
                "concurrency": w["concurrency"],
                "requests": w["requests"],
                "with_drafter_tokens_per_second": w["output_tokens_per_second"],
                "without_drafter_tokens_per_second": b["output_tokens_per_second"],
                "speedup": w["output_tokens_per_second"] / b["output_tokens_per_second"] if b["output_tokens_per_second"] else None,
                "with_drafter": w,
                "without_drafter": b,
            }
        )
    return rows


def run_evaluation(
    drafter: str,
    prompts_path: str,
    target: str,
    train_summary: str,
    out: dict,
    params: dict,
    *,
    layout: RunLayout,
    variant: str | None = None,
    host_lock_enabled: bool = True,
) -> dict:
    """The evaluate_drafter job: τ of ``drafter`` in vLLM, then what it buys in output tokens/s.

    Before any engine, the drafter's files are checked against the record training wrote
    (:func:`eagle3_pipeline.io.check_recorded_files`). Under the host-wide full-model lock,
    engines a killed job of the run left are ended (their records are the run's
    :meth:`~eagle3_pipeline.layout.RunLayout.pids`, a sweep variant's too) and the GPUs checked
    free; then one engine serves the target with the drafter (``speculative_config`` EAGLE-3, k
    ``params["num_speculative_tokens"]``) for τ (:func:`run_eval`) and the decoding throughput with the
    drafter (:func:`throughput_runs`), is shut down, and, when ``evaluation.speedup.concurrency``
    is set, a second engine of the same settings decodes the answered prompts with the target
    alone (:func:`speedup_table`). Each engine's processes are recorded while it runs
    (:class:`eagle3_pipeline.hygiene.ProcessRecord`), so that a rerun ends those a killed job left.

    Args:
        drafter: the drafter directory (speculators format).
        prompts_path: ``eval/prompts.jsonl``: the held-out questions.
        target: target model directory.
        train_summary: the drafter's ``train/summary.json`` (its offline validation is reported beside τ).
        out: output paths ``{"acceptance", "outputs", "rejects"}``.
        params: ``{"evaluation", "num_speculative_tokens", "generation", "vllm", "seed", "max_seq_len",
            "trust_remote_code"}`` (the rule's params).
        layout: the run's layout (:class:`eagle3_pipeline.layout.RunLayout`): where the process records go.
        variant: the sweep variant whose drafter this is, or None for the run's own (names the record).
        host_lock_enabled: hold the host-wide full-model lock while the engines run.

    Returns:
        the acceptance report written to ``out["acceptance"]`` (:func:`acceptance_report` fields,
        ``num_prompts``, ``speedup`` when measured, the drafter, engine, timings, peak memory).

    Raises:
        InputError: the drafter's files differ from training's record, no evaluation prompt fits
            ``max_seq_len``, or this platform's vLLM cannot draft for the target.
        RuntimeError: other processes hold the GPUs, or vLLM reported no drafts.
    """
    from pathlib import Path

    from .engine import build_llm, engine_identity, shutdown_llm
    from .hygiene import ProcessRecord, check_gpus_free, cleanup_stale_processes, host_lock
    from .io import check_recorded_files, read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
    from .runtime import Timer, peak_memory
    from .target_model import load_tokenizer

    drafter = str(Path(drafter).resolve())
    check_recorded_files(drafter, exhaustive=True)  # the bytes training wrote, or an error naming the file (before any engine)
    k = params["num_speculative_tokens"]
    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
    pids = ProcessRecord(layout.pids(), "evaluate_drafter" + (f"-{variant}" if variant else ""))
    engine_args = {
        "seed": params["seed"],
        "max_model_len": params["max_seq_len"],
        "trust_remote_code": params["trust_remote_code"],
    }
    with host_lock(enabled=host_lock_enabled):
        cleanup_stale_processes(pids.path.parent)
        check_gpus_free()
        load = Timer()
        llm = build_llm(target, params["vllm"], speculative_config=spec, **engine_args)
        load_s = load.seconds
        pids.record()
        questions = list(read_jsonl(prompts_path))
        tokenizer = load_tokenizer(target, params["trust_remote_code"])
        prompts = eval_prompt_ids(tokenizer, questions, params["generation"]["chat_template_kwargs"])
        eval_cfg = params["evaluation"] | {"num_speculative_tokens": k}
        run = Timer()
        report, rows, rejects = run_eval(llm, questions, prompts, eval_cfg, params["max_seq_len"])
        eval_s = run.seconds
        # what the drafter buys: the answered prompts decoded with it, then by the target alone
        answered = {r["id"] for r in rows}
        prompts = [p for q, p in zip(questions, prompts, strict=True) if q["id"] in answered]
        with_drafter = throughput_runs(llm, prompts, eval_cfg, "with the drafter")
        shutdown_llm(llm)
        pids.clear()
        if with_drafter:
            base = build_llm(target, params["vllm"], **engine_args)
            pids.record()
            without = throughput_runs(base, prompts, eval_cfg, "without the drafter", warm_up=True)
            shutdown_llm(base)
            pids.clear()
            report["speedup"] = speedup_table(with_drafter, without)
    report |= {
        "drafter": drafter,
        "engine": engine_identity(),
        "model_load_seconds": round(load_s, 3),
        "seconds": round(eval_s, 3),
        "offline_validation": read_json(train_summary).get("final_val", {}),
    } | peak_memory()
    write_jsonl_atomic(out["outputs"], rows)
    write_jsonl_atomic(out["rejects"], rejects)
    write_json_atomic(out["acceptance"], report)
    logger.info("acceptance length tau = %.3f (%d drafts)", report["acceptance_length"], report["num_drafts"])
    return report

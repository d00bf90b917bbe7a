"""Rule evaluate_drafter: acceptance length (tau) of the drafter measured in vLLM."""

import logging
from pathlib import Path

from eagle3_pipeline.engine import build_llm, engine_identity, shutdown_llm
from eagle3_pipeline.evaluation import eval_prompt_ids, run_eval, speedup_table, throughput_runs
from eagle3_pipeline.hygiene import ProcessRecord, check_gpus_free, cleanup_stale_processes, host_lock
from eagle3_pipeline.io import check_recorded_files, read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
from eagle3_pipeline.runtime import Timer, peak_memory, start_log
from eagle3_pipeline.target_model import load_tokenizer

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    k = sm.params.num_speculative_tokens
    drafter = str(Path(sm.input.drafter).resolve())
    check_recorded_files(drafter, exhaustive=True)  # the bytes training wrote, or an error naming the file (before any engine)
    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
    # the run's process records (results/<run>/.pids), for a sweep variant's evaluation too
    variant = getattr(sm.wildcards, "variant", None)
    name = "evaluate_drafter" + (f"-{variant}" if variant else "")
    pids = ProcessRecord(Path("results", sm.config["run"], ".pids"), name)
    # read from the config, not a param: changing it (local vs cluster) must not rerun the job
    with host_lock(enabled=sm.config["resources"]["host_lock"]):
        cleanup_stale_processes(pids.path.parent)
        check_gpus_free()
        load = Timer()
        llm = build_llm(
            sm.input.target,
            sm.params.vllm,
            seed=sm.params.seed,
            max_model_len=sm.params.max_seq_len,
            speculative_config=spec,
            trust_remote_code=sm.params.trust_remote_code,
        )
        load_s = load.seconds
        pids.record()
        questions = list(read_jsonl(sm.input.prompts))
        tokenizer = load_tokenizer(sm.input.target, sm.params.trust_remote_code)
        prompts = eval_prompt_ids(tokenizer, questions, sm.params.generation["chat_template_kwargs"])
        eval_cfg = sm.params.evaluation | {"num_speculative_tokens": k}
        run = Timer()
        report, rows, rejects = run_eval(llm, questions, prompts, eval_cfg, sm.params.max_seq_len)
        eval_s = run.seconds
        # what the drafter buys: the answered prompts decoded with it, then by the target alone
        answered = {r["id"] for r in rows}
        prompts = [p for q, p in zip(questions, prompts, strict=True) if q["id"] in answered]
        with_drafter = throughput_runs(llm, prompts, eval_cfg, "with the drafter")
        shutdown_llm(llm)
        pids.clear()
        if with_drafter:
            base = build_llm(
                sm.input.target,
                sm.params.vllm,
                seed=sm.params.seed,
                max_model_len=sm.params.max_seq_len,
                trust_remote_code=sm.params.trust_remote_code,
            )
            pids.record()
            without = throughput_runs(base, prompts, eval_cfg, "without the drafter", warm_up=True)
            shutdown_llm(base)
            pids.clear()
            report["speedup"] = speedup_table(with_drafter, without)
    train_summary = read_json(sm.input.train_summary)
    report |= {
        "drafter": drafter,
        "engine": engine_identity(),
        "model_load_seconds": round(load_s, 3),
        "seconds": round(eval_s, 3),
        "offline_validation": train_summary.get("final_val", {}),
    } | peak_memory()
    write_jsonl_atomic(sm.output.outputs, rows)
    write_jsonl_atomic(sm.output.rejects, rejects)
    write_json_atomic(sm.output.acceptance, report)
    logging.getLogger("evaluate_drafter").info(
        "acceptance length tau = %.3f (%d drafts)", report["acceptance_length"], report["num_drafts"]
    )

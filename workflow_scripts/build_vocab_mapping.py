"""Rule build_vocab_mapping: supervised-token frequencies -> d2t / t2d (speculators semantics)."""

import logging
from pathlib import Path

from eagle3_pipeline.io import record_files, save_npy_atomic, write_json_atomic
from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.target_model import target_vocab_size
from eagle3_pipeline.vocab import choose_mapping, count_supervised_tokens, coverage_report, recorded_completions

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    completions = recorded_completions(sm.input.traces)  # each shard the bytes generation recorded
    counts = count_supervised_tokens(completions, target_vocab_size(sm.input.target, sm.params.trust_remote_code))
    d2t, t2d, origin = choose_mapping(counts, sm.params.draft_vocab_size, sm.params.init_from)
    for key, arr in (("token_freq", counts), ("d2t", d2t), ("t2d", t2d)):
        save_npy_atomic(sm.output[key], arr)
    # what training checks before it reads them (io.check_recorded_files)
    record_files(Path(sm.output.d2t).parent, [Path(sm.output[k]).name for k in ("d2t", "t2d", "token_freq")])
    report = coverage_report(counts, t2d, sm.params.draft_vocab_size) | {"mapping": origin}
    write_json_atomic(sm.output.coverage, report)
    logging.getLogger("build_vocab_mapping").info(
        "draft vocab %d of %d: coverage %.4f of %d supervised tokens (%d distinct)",
        report["draft_vocab_size"],
        report["target_vocab_size"],
        report["coverage"],
        report["supervised_tokens"],
        report["distinct_supervised_tokens"],
    )

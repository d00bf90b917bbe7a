"""Rule extract_hidden_states: prefill one trace shard through the target, store hidden states."""

import logging

import torch

from eagle3_pipeline.conventions import resolve_layer_ids
from eagle3_pipeline.hidden_states import STORAGE_DTYPES, extract_hf, load_hf_target, sample_from_trace, write_shard
from eagle3_pipeline.io import read_jsonl
from eagle3_pipeline.runtime import Timer, peak_rss_bytes, start_log
from eagle3_pipeline.target_model import num_hidden_layers

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    log = logging.getLogger("extract_hidden_states")
    torch.set_num_threads(sm.threads)
    cfg = sm.params.extraction
    aux, layer_ids = resolve_layer_ids(cfg["aux_layer_ids"], num_hidden_layers(sm.input.target, sm.params.trust_remote_code))
    samples = [sample_from_trace(t, sm.params.max_seq_len) for t in read_jsonl(sm.input.traces)]
    load = Timer()
    model = load_hf_target(sm.input.target, cfg["device"], sm.params.trust_remote_code)
    load_s = load.seconds
    run = Timer()
    states = extract_hf(model, samples, layer_ids, batch_tokens=cfg["batch_tokens"], storage_dtype=STORAGE_DTYPES[cfg["storage_dtype"]])
    index = write_shard(sm.output.shard, samples, states, layer_ids=layer_ids, aux_layer_ids=aux, index_path=sm.output.index)
    secs = run.seconds
    log.info(
        "extracted %d samples, %d tokens, layers %s in %.1f s (%.0f tok/s, model load %.1f s, %.1f MB written, peak RSS %.0f MB)",
        index["num_samples"],
        index["num_tokens"],
        layer_ids,
        secs,
        index["num_tokens"] / secs,
        load_s,
        index["bytes"] / 1e6,
        peak_rss_bytes() / 1e6,
    )

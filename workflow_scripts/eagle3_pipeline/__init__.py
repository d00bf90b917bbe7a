"""eagle3-pipeline library: the logic behind each Snakemake rule.

One module per concern, one hop from each rule:

==========================  ======================================
rule                        module
==========================  ======================================
prepare_target_model        :mod:`eagle3_pipeline.target_model`
prepare_prompts             :mod:`eagle3_pipeline.prompts`
generate_traces             :mod:`eagle3_pipeline.generation`
build_vocab_mapping         :mod:`eagle3_pipeline.vocab`
extract_hidden_states       :mod:`eagle3_pipeline.hidden_states`
train_drafter               :mod:`eagle3_pipeline.training`
evaluate_drafter            :mod:`eagle3_pipeline.evaluation`
==========================  ======================================

Conventions shared by several stages (layer ids, loss mask, token alignment) are
named once, in :mod:`eagle3_pipeline.conventions`. The hidden-state shard format is
:mod:`eagle3_pipeline.shards` (what training reads); extraction's backends are
:mod:`eagle3_pipeline.hf_backend` and :mod:`eagle3_pipeline.vllm_extraction`. Generation and
extraction run as one resumable per-shard job (:mod:`eagle3_pipeline.shard_job`: host-wide lock,
chunk store, stale engines, replicas); they say only what a chunk is and how to assemble it.
"""

__version__ = "0.1.0"

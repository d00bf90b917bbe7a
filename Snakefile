# eagle3-pipeline: prompts -> traces -> draft vocab -> hidden states -> EAGLE-3 drafter -> tau in vLLM.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/prepare_target_model.smk"
include: "rules/prepare_prompts.smk"
include: "rules/generate_traces.smk"
include: "rules/build_vocab_mapping.smk"
include: "rules/extract_hidden_states.smk"
include: "rules/train_drafter.smk"
include: "rules/evaluate_drafter.smk"
include: "rules/summarize_run.smk"
include: "rules/plot_run.smk"
include: "rules/sweep.smk"
include: "rules/write_manifest.smk"
include: "rules/verify.smk"
include: "rules/plan.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),

# Config validation, constants, wildcard constraints and input functions: the only place with
# Python helpers, which rules call by name. Their logic is the library's (eagle3_pipeline.config,
# .layout, .sweep, .lineage, .snakemake_adapter, .target_model).
import sys
from functools import cache, partial
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "workflow_scripts"))

from eagle3_pipeline import config as settings
from eagle3_pipeline import sweep, target_model
from eagle3_pipeline.layout import BUILTIN_TARGET_DIR, RunLayout, shard_ids
from eagle3_pipeline.lineage import external_sources, lineage_terminals
from eagle3_pipeline.prompts import prompt_source_groups, sources_digest
from eagle3_pipeline.snakemake_adapter import lineage_jobs, workflow_errors

# validate_config also turns the strings that nested --config values arrive as (profiles/slurm's
# `resources: {host_lock: false}`, `--config "vllm={data_parallel_size: 2}"`) into the schema's
# types; job_settings gives the GPUs per full-model job and the stages' params; variant_configs
# each sweep variant's full, validated config.
with workflow_errors():
    _validated = settings.validate_config(config)
    config.clear()
    config.update(_validated)
    _J = settings.job_settings(config)
    VARIANTS = sweep.variant_configs(config)

# Full-model stages (generation, extraction, evaluation) each declare full_model=1, so
# at most one runs at a time unless --resources sets full_model itself (profiles/slurm).
workflow.global_resources.setdefault("full_model", 1)

RUN = config["run"]
# every path under results/<run>/ and logs/<run>/ (eagle3_pipeline/layout.py)
layout = RunLayout(RUN)
SHARDS = shard_ids(config["prompts"]["num_shards"])
# every shard's files, for the rules that read them all
TRACE_SHARDS = [layout.traces(s) for s in SHARDS]
TRACE_SUMMARIES = [layout.trace_summary(s) for s in SHARDS]
HIDDEN_STATE_SHARDS = [layout.hidden_states(s) for s in SHARDS]
HIDDEN_STATE_INDEXES = [layout.hidden_index(s) for s in SHARDS]
GENERATION_GPUS, EXTRACTION_GPUS = _J["generation_gpus"], _J["extraction_gpus"]
EVALUATION_GPUS, TRAIN_PROCESSES = _J["evaluation_gpus"], _J["train_processes"]
VLLM_PARAMS, GENERATION_PARAMS = _J["vllm_params"], _J["generation_params"]
EXTRACTION_PARAMS = _J["extraction_params"]
TRAINING_PARAMS = settings.result_settings(config, "training")
# With variants, trainings and evaluations interleave: every training then takes the
# full-model lock too, so no training holds the GPU that an evaluation's engine needs (the
# GPU-free check before each full-model job would stop the evaluation).
TRAIN_FULL_MODEL = 1 if VARIANTS else 0
# Job order when several are ready: the run's own drafter is trained and evaluated before any
# variant's, and a variant's evaluation runs as soon as its drafter exists, before the next
# variant's training, so a sweep cut short leaves finished rows rather than untested drafters.
RUN_PRIORITY = 2
VARIANT_EVAL_PRIORITY = 1
VARIANT_TRAIN_PRIORITY = 0
THREADS = config["resources"]["threads"]


wildcard_constraints:
    shard=r"\d{5}",
    variant=sweep.NAME,


def is_builtin_target():
    return config["target"]["path"] == target_model.BUILTIN_TARGET


def get_target_dir(wildcards=None):
    """The target model directory (materialized builtin, or the user's)."""
    with workflow_errors("target.path"):
        return target_model.configured_target_dir(config["target"]["path"])


def get_user_target_dir():
    """The user's target directory, or None for the embedded target, which a job makes: what
    checks made before any job runs (the run's start, `snakemake plan`) can read."""
    return None if is_builtin_target() else get_target_dir()


def get_target_identity():
    """Content identity of the target for params (re-runs every stage that reads it)."""
    with workflow_errors("target.path"):
        return target_model.configured_target_identity(config["target"]["path"])


def get_sources_digest(groups):
    """Content digest of prompt sources for params (re-runs the rule that reads them on edits);
    ``groups``: {config key: its sources} (prompts.sources_digest)."""
    with workflow_errors():
        return sources_digest(groups)


def get_init_drafter_identity(cfg=None):
    """Content identity of the warm-start drafter (training.init_from of the run, or of ``cfg``), or None."""
    with workflow_errors("training.init_from"):
        return target_model.init_drafter_identity(
            (cfg or config)["training"]["init_from"]
        )


def get_variant_vocab(wildcards):
    """A variant's d2t and t2d (training's inputs): the run's unless its vocab settings differ."""
    v = wildcards.variant
    own = sweep.vocab_layout(config, VARIANTS[v], layout, v)
    return {k: own.vocab(k) for k in ("d2t", "t2d")}


def get_variant_drafter(wildcards):
    """A variant's drafter and its training summary: the run's unless vocab or training differ."""
    v = wildcards.variant
    own = sweep.drafter_layout(config, VARIANTS[v], layout, v)
    return {"drafter": own.drafter(), "train_summary": own.train_summary()}


def get_final_outputs():
    """What a run makes: the drafter, tau, the run summary, the report's figures (rule plot_run) and
    the run manifest. The drafter is named itself so that a run whose drafter is missing (an
    interrupted `--forcerun train_drafter`) trains it again rather than report nothing to do.
    """
    return [
        layout.drafter(),
        layout.acceptance(),
        layout.summary(),
        *rules.plot_run.output,
        *rules.write_manifest.output,
        *(rules.sweep_table.output if VARIANTS else []),
    ]


def get_lineage_jobs(wildcards=None):
    """Every job that makes the run's outputs (but the manifest), read from the rules' declared files."""
    return _lineage_jobs()


@cache
def _lineage_jobs():
    # walked once per workflow: rule write_manifest asks twice (its input and its params)
    finals = [f for f in get_final_outputs() if f != layout.manifest()]
    wildcard_values = {"shard": SHARDS, "variant": list(VARIANTS)}
    sources = partial(external_sources, config, VARIANTS)
    return lineage_jobs(workflow, rules, finals, wildcard_values, sources)


def get_lineage_terminals(wildcards):
    """The outputs of the run's jobs that none of them reads (the run manifest's inputs)."""
    return lineage_terminals(get_lineage_jobs())


# settings that depend on the target's shape (the run's and each variant's), before any job runs
with workflow_errors("target.path"):
    _shape = target_model.configured_target_shape(config["target"]["path"])
    _model_type = target_model.configured_target_model_type(config["target"]["path"])
    _context = target_model.configured_target_context(config["target"]["path"])
with workflow_errors():
    settings.check_run_against_target(config, VARIANTS, *_shape, _model_type, _context)

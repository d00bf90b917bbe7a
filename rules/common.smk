# Config validation, wildcard constraints, resource defaults and input functions.
# The only place with Python helpers; rules call these by name.
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(workflow.basedir) / "workflow_scripts"))

from snakemake.exceptions import WorkflowError

from eagle3_pipeline.config import (
    ConfigError,
    check_against_target,
    job_settings,
    result_settings,
    validate_config,
)
from eagle3_pipeline.io import InputError
from eagle3_pipeline.layout import BUILTIN_TARGET_DIR, RunLayout
from eagle3_pipeline.lineage import external_sources
from eagle3_pipeline.prompts import sources_digest
from eagle3_pipeline.snakemake_adapter import lineage_jobs
from eagle3_pipeline.sweep import (
    changes,
    shares_drafter,
    shares_vocab,
    variant_configs,
)
from eagle3_pipeline.target_model import (
    BUILTIN_SHAPE,
    BUILTIN_TARGET,
    check_target_dir,
    quick_identity,
    target_shape,
)

# validate_config also turns the strings that nested --config values arrive as (profiles/slurm's
# `resources: {host_lock: false}`, `--config "vllm={data_parallel_size: 2}"`) into the
# schema's types.
try:
    _validated = validate_config(config)
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_validated)

# Full-model stages (generation, extraction, evaluation) each declare full_model=1, so
# at most one runs at a time unless --resources sets full_model itself (profiles/slurm).
workflow.global_resources.setdefault("full_model", 1)

RUN = config["run"]
# every path under results/<run>/ and logs/<run>/ (eagle3_pipeline/layout.py)
layout = RunLayout(RUN)
SHARDS = [f"{i:05d}" for i in range(config["prompts"]["num_shards"])]
try:
    _J = job_settings(
        config
    )  # GPUs per full-model job, params (eagle3_pipeline/config.py)
except ConfigError as e:
    raise WorkflowError(str(e))
GENERATION_GPUS, EXTRACTION_GPUS = _J["generation_gpus"], _J["extraction_gpus"]
EVALUATION_GPUS, TRAIN_PROCESSES = _J["evaluation_gpus"], _J["train_processes"]
VLLM_PARAMS, GENERATION_PARAMS = _J["vllm_params"], _J["generation_params"]
EXTRACTION_PARAMS = _J["extraction_params"]


def training_params(cfg):
    """A config's training settings as params, without those that change no result (loader processes)."""
    return result_settings(cfg, "training")


TRAINING_PARAMS = training_params(config)
# Drafter variants of this run (sweep.variants): each one's full, validated config.
try:
    VARIANTS = variant_configs(config)
except ConfigError as e:
    raise WorkflowError(str(e))
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
    variant=r"[A-Za-z0-9][A-Za-z0-9._-]*",


def is_builtin_target():
    return config["target"]["path"] == BUILTIN_TARGET


def get_target_dir(wildcards=None):
    """The target model directory (materialized builtin, or the user's)."""
    if is_builtin_target():
        return BUILTIN_TARGET_DIR
    try:
        return str(check_target_dir(config["target"]["path"]))
    except InputError as e:
        raise WorkflowError(f"target.path: {e}")


def check_config_against_target():
    """Settings that depend on the target's shape (the run's and each variant's), checked before any job runs."""
    if is_builtin_target():
        shape = BUILTIN_SHAPE
    else:
        shape = target_shape(get_target_dir())
    try:
        check_against_target(config, *shape)
        for name, cfg in VARIANTS.items():
            try:
                check_against_target(cfg, *shape)
            except ConfigError as e:
                raise ConfigError(f"sweep.variants.{name}: {e}") from None
    except ConfigError as e:
        raise WorkflowError(str(e))


def get_target_identity():
    """Content identity of the target for params (re-runs every stage that reads it)."""
    if is_builtin_target():
        return BUILTIN_TARGET
    return quick_identity(get_target_dir())


def get_prompt_sources_digest():
    """Content digest of the prompt and evaluation sources (re-runs prepare_prompts on edits)."""
    try:
        return sources_digest(
            config["prompts"]["sources"] + [config["evaluation"]["prompts"]]
        )
    except InputError as e:
        raise WorkflowError(f"prompts.sources: {e}")


def get_eval_sources_digest():
    try:
        return sources_digest([config["evaluation"]["prompts"]])
    except InputError as e:
        raise WorkflowError(f"evaluation.prompts: {e}")


def get_init_drafter_identity(cfg=None):
    """Content identity of the warm-start drafter (training.init_from of the run, or of ``cfg``), or None."""
    path = (cfg or config)["training"]["init_from"]
    if path is None:
        return None
    if not Path(path, "config.json").is_file():
        raise WorkflowError(
            f"training.init_from: {path} is not a drafter directory (no config.json)"
        )
    return quick_identity(path)


def get_prompt_shard(wildcards):
    return layout.prompt_shard(wildcards.shard)


def get_trace_shards(wildcards):
    return [layout.traces(s) for s in SHARDS]


def get_trace_shard(wildcards):
    return layout.traces(wildcards.shard)


def get_hidden_state_shards(wildcards):
    return [layout.hidden_states(s) for s in SHARDS]


def get_trace_summaries(wildcards):
    return [layout.trace_summary(s) for s in SHARDS]


def get_hidden_state_indexes(wildcards):
    return [layout.hidden_index(s) for s in SHARDS]


def get_num_speculative_tokens(cfg=None):
    cfg = cfg or config
    k = cfg["evaluation"]["num_speculative_tokens"]
    return k if k is not None else cfg["training"]["ttt_steps"]


def eval_vllm_params(cfg=None):
    """The evaluation engine's vllm settings: the run's (or ``cfg``'s), with evaluation.enforce_eager if set."""
    eager = (cfg or config)["evaluation"]["enforce_eager"]
    return VLLM_PARAMS | ({} if eager is None else {"enforce_eager": eager})


def vocab_layout(variant):
    """The layout whose draft vocab a variant uses: the run's own unless its vocab settings differ."""
    shared = shares_vocab(config, VARIANTS[variant])
    return layout if shared else layout.variant(variant)


def drafter_layout(variant):
    """The layout whose drafter a variant uses: the run's own unless vocab or training differ."""
    shared = shares_drafter(config, VARIANTS[variant])
    return layout if shared else layout.variant(variant)


def get_variant_vocab(wildcards):
    """A variant's d2t and t2d (training's inputs)."""
    return {k: vocab_layout(wildcards.variant).vocab(k) for k in ("d2t", "t2d")}


def get_variant_drafter(wildcards):
    """A variant's drafter and its training summary."""
    own = drafter_layout(wildcards.variant)
    return {"drafter": own.drafter(), "train_summary": own.train_summary()}


def get_sweep_rows():
    """The sweep table's drafters, the run's own first: name, changes, whether the drafter is
    the run's own, and its acceptance, training summary and coverage files."""
    rows = [
        {
            "name": "(run)",
            "changes": {},
            "shared": False,
            "acceptance": layout.acceptance(),
            "train_summary": layout.train_summary(),
            "coverage": layout.coverage(),
        }
    ]
    for v, cfg in VARIANTS.items():
        rows.append(
            {
                "name": v,
                "changes": changes(config, cfg),
                "shared": shares_drafter(config, cfg),
                "acceptance": layout.variant(v).acceptance(),
                "train_summary": drafter_layout(v).train_summary(),
                "coverage": vocab_layout(v).coverage(),
            }
        )
    return rows


check_config_against_target()


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
    """Every job that makes the run's outputs (but the manifest) as ``{rule, wildcards, inputs,
    outputs, sources}``, read from the rules' declared files: the manifest's graph is the workflow's.
    """
    return lineage_jobs(
        workflow,
        rules,
        [f for f in get_final_outputs() if f != layout.manifest()],
        {"shard": SHARDS, "variant": list(VARIANTS)},
        partial(external_sources, config),
    )


def get_lineage_outputs(wildcards):
    """Every output file of the run's jobs (the run manifest's inputs)."""
    return sorted(
        {p for job in get_lineage_jobs() for ps in job["outputs"].values() for p in ps}
    )

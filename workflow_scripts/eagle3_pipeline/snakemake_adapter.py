"""The one module that reads Snakemake's internals (snakemake 9.27.1): the jobs of a DAG, the rules.

Snakemake has no public API that lists the jobs a run will run, the rules a job belongs to, or
the rules' declared files as the workflow holds them; what the workflow needs of them is read
here, and nowhere else, so that a change of Snakemake's internals fails in one place
(``tests/test_plan.py`` checks :func:`needrun_jobs` against the public list of updated files):

- :func:`needrun_jobs` / :func:`dry_run_jobs`: the jobs a run (the ``onstart`` hook) or a dry-run
  (``snakemake plan``) will run, for :mod:`eagle3_pipeline.plan`;
- :func:`rule_stage`: the stage of a rule, from the script it runs (a sweep variant's rule reuses
  its stage's script), so that no list of rule names is kept by hand;
- :func:`on_start` and :func:`print_resume_hint`: the bodies of the ``onstart`` and ``onerror``
  hooks (rules/plan.smk);
- :func:`incomplete_outputs`: the outputs Snakemake marked incomplete;
- :func:`lineage_jobs`: every job of the run with its declared files, for the run manifest
  (rules/write_manifest.smk);
- :func:`workflow_errors`: the library's configuration and input errors as Snakemake's own, for
  rules/common.smk.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

from .config import ConfigError
from .io import InputError
from .layout import RunLayout


@contextlib.contextmanager
def workflow_errors(key: str | None = None) -> Iterator[None]:
    """Report a :class:`~eagle3_pipeline.config.ConfigError` or :class:`~eagle3_pipeline.io.InputError`
    raised in the block as Snakemake's ``WorkflowError``: one message, no traceback, when the
    Snakefile is read.

    Args:
        key: the config key the block reads (``"target.path"``), put before the message; None when
            the message names its keys itself.

    Raises:
        snakemake.exceptions.WorkflowError: instead of those errors.
    """
    from snakemake.exceptions import WorkflowError

    try:
        yield
    except (ConfigError, InputError) as e:
        raise WorkflowError(f"{key}: {e}" if key else str(e)) from None


def rule_stage(rule) -> str:
    """The stage a Snakemake rule belongs to: the name of the script it runs (one script per stage:
    ``train_drafter_variant`` runs ``train_drafter.py``), or its name when it runs none (``all``)."""
    script = getattr(rule, "script", None)
    return Path(script).stem if script else rule.name


def needrun_jobs(workflow) -> list[dict]:
    """The jobs Snakemake will run, from the DAG a Snakemake ``Workflow`` has built.

    Returns ``[{"rule": name, "stage": name, "wildcards": {name: value}, "input": [paths], "output":
    [paths]}]`` in dependency order (:func:`in_dependency_order`). ``stage`` is :func:`rule_stage`.

    Snakemake internals (snakemake 9.27.1; no public API returns the jobs): ``Workflow.dag``,
    which ``Workflow.execute`` builds and post-processes before it calls the ``onstart`` hook
    (and keeps after a dry-run), ``DAG.needrun_jobs(exclude_finished=False)`` (a dry-run marks
    its jobs finished), ``Job.rule.name``, ``Job.wildcards_dict`` and ``Job.output``. The
    public ``DAGApi.execute_workflow(updated_files=...)`` lists the same jobs' output files;
    ``tests/test_plan.py`` checks this function against it, so a change of these internals
    fails there.

    Raises:
        AttributeError: the workflow has no DAG yet, or Snakemake's internals changed.
    """
    jobs = [
        {
            "rule": j.rule.name,
            "stage": rule_stage(j.rule),
            "wildcards": {k: str(v) for k, v in j.wildcards_dict.items()},
            "output": [str(f) for f in j.output],
            "input": [str(f) for f in j.input],
            "named_input": {k: [str(f) for f in v] if isinstance(v, list) else [str(v)] for k, v in j.input.items()},
        }
        for j in workflow.dag.needrun_jobs(exclude_finished=False)
    ]
    return in_dependency_order(jobs)


def in_dependency_order(jobs: list[dict]) -> list[dict]:
    """``jobs`` (with ``"input"`` and ``"output"`` paths) sorted so that a job comes after every
    job whose output it reads (a file, or one inside an output directory); jobs of one level by
    rule and wildcards. Snakemake's own order is a set's, different at every call."""
    producer = {o: i for i, j in enumerate(jobs) for o in j["output"]}

    def made_by(path: str) -> int | None:
        p = Path(path)
        for q in (p, *p.parents):
            if str(q) in producer:
                return producer[str(q)]
        return None

    deps = [{d for f in j["input"] if (d := made_by(f)) is not None and d != i} for i, j in enumerate(jobs)]
    level: dict[int, int] = {}

    def depth(i: int, seen: frozenset = frozenset()) -> int:
        if i not in level:
            level[i] = 1 + max((depth(d, seen | {i}) for d in deps[i] if d not in seen), default=-1)
        return level[i]

    key = [(depth(i), j["rule"], sorted(j["wildcards"].items())) for i, j in enumerate(jobs)]
    return [jobs[i] for i in sorted(range(len(jobs)), key=key.__getitem__)]


def incomplete_outputs(workflow) -> set[str]:
    """The outputs of the jobs Snakemake will run that it marked incomplete: their job started
    and Snakemake did not see it end (it was killed, or the job failed and left them).

    Snakemake internals (snakemake 9.27.1; the public API only reports such files as an error):
    ``Workflow.dag.needrun_jobs``, ``Workflow.persistence._get_key`` and
    ``Workflow.persistence._filter_incomplete_keys``; ``tests/test_workflow_dag.py`` kills a
    snakemake during a job and checks this against the file it left.
    """
    keys = {workflow.persistence._get_key(f): str(f) for j in workflow.dag.needrun_jobs(exclude_finished=False) for f in j.output}
    return {keys[k] for k in workflow.persistence._filter_incomplete_keys(keys)}


def snakemake_makers(workflow) -> Callable[[str], tuple[str, float | None] | None]:
    """Which job Snakemake recorded as the maker of an input of the jobs it will run: ``path ->
    (rule, endtime)``, ``endtime`` the file's modification time (seconds since the epoch) Snakemake
    recorded when that job ended, None for a path it made no record of (brought from elsewhere, or
    its metadata removed with ``snakemake --cleanup-metadata <path>``). It keeps such metadata of
    each output it made, in ``.snakemake/``.

    Snakemake internals (snakemake 9.27.1): ``Workflow.dag.needrun_jobs``, ``Job.input`` and
    ``Workflow.persistence.metadata`` (its ``rule`` and ``endtime``); ``tests/test_verify.py``
    removes a finished run's drafter record and checks that the run refuses, and runs once
    Snakemake's metadata of it is removed, and edits a finished run's evaluation questions and
    checks that the run refuses. The DAG is walked at the first call only.
    """
    files: dict | None = None

    def maker(path: str) -> tuple[str, float | None] | None:
        nonlocal files
        if files is None:
            files = {str(f): f for j in workflow.dag.needrun_jobs(exclude_finished=False) for f in j.input}
        record = workflow.persistence.metadata(files[path]) if path in files else None
        return None if record is None else (record.rule, record.endtime)

    return maker


def keep_incomplete_finished_shards(workflow, jobs: list[dict], layout: RunLayout) -> list[str]:
    """The ``onstart`` hook's step (:func:`on_start`; ``jobs`` as :func:`needrun_jobs` lists them,
    ``layout`` the run's) for the jobs a killed snakemake left marked incomplete
    although they had finished: each generation, extraction or training job whose outputs are all
    marked (:func:`incomplete_outputs`) and whose record names their bytes gets them kept for its
    rerun (:func:`eagle3_pipeline.shard_job.keep_for_rerun`), which takes them back instead of
    doing the work again (training: :func:`eagle3_pipeline.resume.take_back_kept`). Runs before Snakemake deletes those outputs. ``--forcerun`` and changed code or
    settings do not mark outputs incomplete, so such jobs still run.

    Returns:
        the main outputs kept (also printed); empty when Snakemake's internals changed (a warning:
        the jobs then run again, as without this step).
    """
    from .generation import SUMMARY_HASH_KEYS, traces_summary_path
    from .io import check_recorded_files, recorded_sha256
    from .shard_job import keep_for_rerun
    from .shards import INDEX_HASH_KEYS, shard_index_path

    def shard_bytes(keys: tuple[str, str]):  # the main output against the record's keys of its bytes
        return lambda main, record: functools.partial(recorded_sha256, main, record, *keys)

    # per stage (its rule's first output is the main one): its job's record among the outputs, and the
    # check of the main output against its record (training: the drafter folder's own record of files)
    stages = {
        "generate_traces": (lambda job: str(traces_summary_path(job["output"][0])), shard_bytes(SUMMARY_HASH_KEYS)),
        "extract_hidden_states": (lambda job: str(shard_index_path(job["output"][0])), shard_bytes(INDEX_HASH_KEYS)),
        "train_drafter": (
            lambda job: layout.of_job(job.get("wildcards", {})).train_summary(),
            lambda main, _record: functools.partial(check_recorded_files, main, exhaustive=True),
        ),
    }
    try:
        marked = incomplete_outputs(workflow)
        jobs = [j for j in jobs if j["stage"] in stages and j["output"] and set(j["output"]) <= marked]
    except AttributeError as e:
        print(f"(finished jobs marked incomplete not looked for: {type(e).__name__}: {e})", file=sys.stderr)
        return []
    kept = []
    for j in jobs:
        record_of, check_of = stages[j["stage"]]
        record = record_of(j)
        outputs = [o for o in j["output"] if o != record]
        if record in j["output"] and keep_for_rerun(outputs, record, check_of(outputs[0], record)):
            kept.append(outputs[0])
    if kept:
        print(
            f"{len(kept)} job(s) had finished but their snakemake was killed before it saw them end; kept for their "
            "jobs, which take them back: " + ", ".join(kept),
            file=sys.stderr,
        )
    return kept


def dry_run_jobs(snakefile: str | Path, workdir: str | Path, config: dict, targets: list[str] | None = None) -> list[dict]:
    """The jobs ``snakemake -n`` would run with ``config``, as :func:`needrun_jobs` returns them.

    A dry-run through ``snakemake.api`` (no lock taken, nothing printed): the DAG is built
    from the same Snakefile, working directory and config, so changed parameters, code or
    inputs trigger reruns exactly as in ``snakemake -n``. ``config`` (a complete, validated
    config) is handed over as a ``--configfile`` (a temporary YAML file), which replaces the
    Snakefile's ``configfile:`` as the user's own ``--configfile`` did. Not JSON: Snakemake
    reads a JSON config file into ``OrderedDict``s, whose repr differs from the plain dicts a
    YAML file gives, and a list of mappings in a rule's params (``prompts.sources``) would then
    count as changed.
    ``targets``: None for the default target. Takes about as long as ``snakemake -n``.

    Reads the DAG through ``WorkflowApi._workflow`` (snakemake 9.27.1; internal, like
    :func:`needrun_jobs`, and checked by the same test).

    Raises:
        snakemake.exceptions.WorkflowError and the like: the workflow does not parse or the
            DAG cannot be built (what ``snakemake -n`` would report).
    """
    import yaml
    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import ConfigSettings, DAGSettings, ExecutionSettings, OutputSettings, ResourceSettings

    with tempfile.TemporaryDirectory() as tmp, SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        configfile = Path(tmp) / "config.yaml"
        configfile.write_text(yaml.safe_dump(config, sort_keys=False))
        wf = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[configfile]),
            snakefile=Path(snakefile).absolute(),
            workdir=Path(workdir).absolute(),
        )
        dag = wf.dag(DAGSettings(targets=set(targets or ())))
        dag.execute_workflow(executor="local", pseudo_executor="dryrun", execution_settings=ExecutionSettings(lock=False))
        return needrun_jobs(wf._workflow)


def target_rules(workflow) -> set[str]:
    """The rules of the targets a Snakemake ``Workflow`` was asked for (``DAG.targetjobs``); empty
    when its DAG is not built or Snakemake's internals changed."""
    try:
        return {job.rule.name for job in workflow.dag.targetjobs}
    except AttributeError:
        return set()


#: The input names of what jobs read against a record of files that its producer always writes
#: (:func:`eagle3_pipeline.io.record_files`, checked by :func:`eagle3_pipeline.io.check_recorded_files`):
#: the drafter folder (``evaluate_drafter``'s and its variants'; the record inside it) and the
#: draft vocabulary's files (``train_drafter``'s; the record in their folder).
RECORDED_INPUTS = ("drafter", "d2t", "t2d")


def _files_record(path: str) -> Path:
    """The record of files that covers ``path``: inside it for a folder, beside it for a file."""
    from .io import FILES_RECORD

    p = Path(path)
    return (p if p.is_dir() else p.parent) / FILES_RECORD


def check_pending_inputs(
    jobs: list[dict],
    made_here: Callable[[str], bool] | None = None,
    written_at: Callable[[str], tuple[str, float | None] | None] | None = None,
) -> None:
    """The ``onstart`` hook's first step (:func:`on_start`; ``jobs`` as :func:`needrun_jobs` lists
    them): refuse the run before any job starts (and before Snakemake
    deletes the outputs of the jobs it reruns) when a file a pending job reads, and no pending job
    remakes, differs from what its producer recorded (:func:`eagle3_pipeline.verify.recorded_input_problems`),
    e.g. a trace shard edited after generation, which would otherwise stop extraction only after
    Snakemake deleted the shard's good hidden states.

    A drafter or draft vocabulary a pending job reads (its input named in :data:`RECORDED_INPUTS`)
    without its record of files (``.sha256.json``, which training and the vocabulary's job write)
    is refused when this workflow made it (``made_here``: Snakemake keeps metadata of the outputs it
    made): its record is gone, so the bytes the stage would read cannot be told from what their
    producer wrote. One Snakemake did not make (brought from elsewhere, or whose metadata the user
    removed with ``snakemake --cleanup-metadata``) is named on the console and used as it is; the
    run's manifest records its bytes.

    A file no record of bytes covers (a prompt shard, the evaluation questions) that was modified
    after the job that wrote it ended is refused too (``written_at``,
    :func:`eagle3_pipeline.verify.modified_after_written`): Snakemake would rerun the stages that
    read it on bytes their producer did not write, and rewrite the run's manifest over the evidence.

    Args:
        made_here: whether Snakemake made a path (``Persistence.metadata``); None: no path is
            taken as made here.
        written_at: ``path -> (rule, endtime)`` of the job Snakemake recorded as its maker, or None
            (:func:`snakemake_makers`); None: no such check.

    Raises:
        snakemake.exceptions.WorkflowError: naming every such file or folder and what to do.
    """
    from snakemake.exceptions import WorkflowError

    from .verify import recorded_input_problems

    remade = {o for j in jobs for o in j["output"]}
    inputs = sorted({f for j in jobs for f in j["input"] if not any(str(q) in remade for q in (Path(f), *Path(f).parents))})
    prompt_shards = [f for j in jobs if j.get("stage") == "generate_traces" for f in j.get("named_input", {}).get("prompts", [])]
    problems = recorded_input_problems(inputs, prompt_shards, written_at)
    if problems:
        raise WorkflowError(
            f"{len(problems)} input file(s) of pending jobs differ from what their producers recorded; nothing was "
            "run or deleted:\n" + "\n".join(f"  {p}" for p in problems)
        )
    from .io import FILES_RECORD

    recorded = {f for j in jobs for name in RECORDED_INPUTS for f in j.get("named_input", {}).get(name, [])}
    unrecorded = [f for f in inputs if f in recorded and Path(f).exists() and not _files_record(f).is_file()]
    lost = [f for f in unrecorded if made_here is not None and made_here(f)]
    if lost:
        raise WorkflowError(
            f"{len(lost)} input(s) of pending jobs were made by this workflow but have lost the record of their files "
            f"({FILES_RECORD}), so what the stage would read cannot be checked against what its producer wrote; "
            "nothing was run or deleted:\n"
            + "\n".join(
                f"  {f}: no {_files_record(f)}; remake it with `snakemake --forcerun {f}` and the run's own options; or, if "
                f"you put {'a folder' if Path(f).is_dir() else 'a file'} of your own there on purpose, `snakemake "
                f"--cleanup-metadata {f}` makes Snakemake forget that it made it, and the run uses it as given (its bytes "
                "go into the run's manifest)"
                for f in lost
            )
        )
    unrecorded = [f for f in unrecorded if f not in lost]
    if unrecorded:
        print(
            f"WARNING: {len(unrecorded)} input(s) of pending jobs were not made by this workflow and have no record of "
            f"their files ({FILES_RECORD}); they are used as given, unchecked, and the run's manifest records their "
            "bytes: " + ", ".join(unrecorded),
            file=sys.stderr,
        )


def check_at_start(jobs: list[dict], config: dict, target_dir: str | None) -> None:
    """The ``onstart`` hook's check of the target and of the settings only a library can check
    (:func:`on_start`), before any job runs (through a cluster profile, before any job is queued):
    :func:`problem_at_start`. A target the engine cannot take, or a loss speculators does not
    know, then stops the run here, not in a GPU job after the prompts were prepared.

    Raises:
        snakemake.exceptions.WorkflowError: the check's error (naming the key or the target, its
            architecture, the versions and what to do); nothing was run.
    """
    from snakemake.exceptions import WorkflowError

    if (why := problem_at_start(jobs, config, target_dir)) is not None:
        raise WorkflowError(f"{why.rstrip('.')}. (Checked at the run's start: nothing was run.)")


def training_loss_problem(jobs: list[dict], config: dict) -> str | None:
    """Why a pending training job's ``training.loss`` (the run's, or its sweep variant's) is not a
    loss speculators knows (``speculators.losses.resolve_loss_config``: a name or a JSON weighted
    combination), or None. The names are speculators', checked with its own parser; importing it
    takes ~4 s, so this runs at the run's start when training is pending, not at every
    ``snakemake -n``."""
    losses = {}
    for j in jobs:
        if j.get("stage", j["rule"]) == "train_drafter":
            v = j.get("wildcards", {}).get("variant")
            key = f"sweep.variants.{v}.training.loss" if v else "training.loss"
            own = config["sweep"]["variants"][v].get("training", {}) if v else {}  # a variant's own setting, else the run's
            losses[key] = own.get("loss", config["training"]["loss"])
    if not losses:
        return None
    from speculators.losses import resolve_loss_config

    for key, loss in losses.items():
        try:
            resolve_loss_config(loss, "eager")
        except ValueError as e:
            return f"{key}: {loss!r} is not a loss speculators knows: {e}"
    return None


def warm_start_problem(jobs: list[dict], config: dict, target_dir: str | None) -> str | None:
    """Why a pending vocab or training job's warm-start drafter (``training.init_from``, the run's
    or its sweep variant's) does not fit the run's settings, or None: its draft vocab size is not
    ``vocab.draft_vocab_size`` (the vocab job keeps the drafter's vocabulary and refuses another
    size), or its aux layer ids are not those its training would use (``training.aux_layer_ids``,
    else the extracted ones: ``extraction.aux_layer_ids`` or the target's default). Both jobs
    check again; this says so before generation and extraction run, which on a large target
    take hours. ``target_dir``: None for the embedded target (its known layer count).

    Raises:
        InputError: the drafter's ``config.json`` cannot be read (names the file).
    """
    from .conventions import default_aux_layer_ids
    from .sweep import variant_configs
    from .target_model import BUILTIN_CONFIG, num_hidden_layers, read_config_json

    variants = None
    for j in jobs:
        stage = j.get("stage", j["rule"])
        if stage not in ("build_vocab_mapping", "train_drafter"):
            continue
        v = j.get("wildcards", {}).get("variant")
        if v and variants is None:
            variants = variant_configs(config)
        cfg, key = (variants[v], f"sweep.variants.{v}.") if v else (config, "")
        init = cfg["training"]["init_from"]
        if not init:
            continue
        drafter = read_config_json(init)
        size = drafter.get("draft_vocab_size")
        if size != cfg["vocab"]["draft_vocab_size"]:
            return (
                f"{key}training.init_from={init} has a draft vocab of {size}, this run {cfg['vocab']['draft_vocab_size']}: "
                f"a warm start keeps its drafter's vocabulary; set {key}vocab.draft_vocab_size: {size}"
            )
        if stage != "train_drafter":
            continue
        aux = cfg["training"]["aux_layer_ids"] or cfg["extraction"]["aux_layer_ids"]
        if aux is None:
            n = (
                BUILTIN_CONFIG["num_hidden_layers"]
                if target_dir is None
                else num_hidden_layers(target_dir, config["target"]["trust_remote_code"])
            )
            aux = default_aux_layer_ids(n)
        own = drafter.get("eagle_aux_hidden_state_layer_ids")
        if list(own or []) != list(aux):
            return (
                f"{key}training.init_from={init} uses aux layer ids {own}, the drafter to train would use {list(aux)}; "
                f"set {key}training.aux_layer_ids (or extraction.aux_layer_ids) to {own}"
            )
    return None


def eval_prompts_problem(jobs: list[dict], config: dict) -> str | None:
    """Why the evaluation questions (``evaluation.prompts``) cannot be read, or None, when a pending
    job reads them (prepare_eval_prompts; prepare_prompts, which decontaminates against them unless
    ``prompts.decontaminate`` is off): a
    missing or empty file, a line without usable turns (:func:`eagle3_pipeline.prompts.load_eval_questions`,
    which those jobs run). Checked at the start because with decontamination off generation does
    not wait for them, and a run would fail only after its jobs running then had finished."""
    from .prompts import load_eval_questions

    def reads(rule: str) -> bool:
        return rule == "prepare_eval_prompts" or (rule == "prepare_prompts" and config["prompts"]["decontaminate"])

    if not any(reads(j["rule"]) for j in jobs):
        return None
    try:
        load_eval_questions(config["evaluation"]["prompts"])
    except InputError as e:
        return str(e)
    return None


def problem_at_start(jobs: list[dict], config: dict, target_dir: str | None) -> str | None:
    """Why a run of ``jobs`` (as :func:`needrun_jobs` lists them) would be refused at its start, or
    None: a pending training job's loss speculators does not know (:func:`training_loss_problem`);
    a pending vocab or training job's warm-start drafter that does not fit (:func:`warm_start_problem`);
    evaluation questions that cannot be read (:func:`eval_prompts_problem`);
    when a ``generate_traces`` job is among them,
    :func:`eagle3_pipeline.target_model.tokenizer_problem` (the tokenizer renders a chat prompt)
    and :func:`eagle3_pipeline.engine.check_eagle3_target` as generation's job runs it (vLLM's model
    class for the architecture and its EAGLE-3 support, vLLM's model config of the target, the
    context against ``max_seq_len``, the config against the weights). Used by the run's start
    (:func:`check_at_start`) and by ``snakemake plan``. Left to generation's job (which
    checks again either way): the embedded target (``target_dir`` None: a job makes it), a run
    with no generation pending, and (for vLLM's checks; the tokenizer is checked there too) a
    machine where vLLM finds no platform (a cluster's login node without GPUs, where its model
    config is not the GPU node's). Importing vLLM takes 5-8 s."""
    if (why := training_loss_problem(jobs, config)) is not None:
        return why
    if (why := warm_start_problem(jobs, config, target_dir)) is not None:
        return why
    if (why := eval_prompts_problem(jobs, config)) is not None:
        return why
    if target_dir is None or not any(j["rule"] == "generate_traces" for j in jobs):
        return None
    from .target_model import tokenizer_problem

    if (why := tokenizer_problem(target_dir, config["target"]["trust_remote_code"])) is not None:
        return why
    from vllm.platforms import current_platform

    from .engine import check_eagle3_target

    if current_platform.is_unspecified():
        print("(vLLM finds no platform on this machine: the target is checked in generation's job)", file=sys.stderr)
        return None
    try:
        check_eagle3_target(target_dir, config["target"]["trust_remote_code"], config["max_seq_len"])
    except InputError as e:
        return str(e)
    return None


def print_start_plan(jobs: list[dict], config: dict, layout: RunLayout, target_dir: str | None) -> None:
    """The ``onstart`` hook's last step (:func:`on_start`): the plan of ``jobs``, the jobs Snakemake's
    DAG will run (as :func:`needrun_jobs` lists them), printed and kept as
    :meth:`RunLayout.start_plan`, when any planned stage has a pending job (so not for
    ``snakemake plan`` itself, whose rule prints its own preview). Never stops a run: a plan is
    advice. ``target_dir``: None for the embedded target (its known shape)."""
    from .io import write_json_atomic
    from .plan import format_plan, plan_dict, plan_run

    try:
        stages, platform = plan_run(config, target_dir, layout.dir, jobs, bench_dir=layout.bench_dir)
    except Exception as e:  # a plan is advice: never stop a run over it
        print(f"(no plan: {type(e).__name__}: {e})", file=sys.stderr)
        return
    if all(s.done for s in stages):
        return
    path = layout.start_plan()
    try:
        write_json_atomic(path, plan_dict(stages, platform, jobs, kind="start"))
    except OSError as e:
        print(f"(plan not kept: {e})", file=sys.stderr)
    print(
        f"plan for run {layout.run!r} on {platform} (estimates; kept as {path}):\n" + format_plan(stages, jobs),
        file=sys.stderr,
    )


def on_start(workflow, config: dict, layout: RunLayout, target_dir: str | None) -> None:
    """The ``onstart`` hook (rules/plan.smk), in order: :func:`check_pending_inputs`,
    :func:`check_at_start`, :func:`keep_incomplete_finished_shards` and
    :func:`print_start_plan`, over one list of the jobs Snakemake will run (:func:`needrun_jobs`;
    Snakemake's DAG is walked once). ``target_dir``: None for the embedded target.

    Raises:
        snakemake.exceptions.WorkflowError: an input of a pending job differs from its producer's
            record, or the target cannot be served, or a Ctrl-C came during these checks; nothing
            was run.
        AttributeError: Snakemake's internals changed (:func:`needrun_jobs`).
    """
    from snakemake.exceptions import WorkflowError

    try:
        jobs = needrun_jobs(workflow)
        makers = snakemake_makers(workflow)
        check_pending_inputs(jobs, lambda path: makers(path) is not None, makers)
        check_at_start(jobs, config, target_dir)
        keep_incomplete_finished_shards(workflow, jobs, layout)
        print_start_plan(jobs, config, layout, target_dir)
    except KeyboardInterrupt:  # a Ctrl-C while the target's libraries load: one line, not their traceback
        raise WorkflowError("interrupted (Ctrl-C) during the run's start checks; no job was started: rerun the command") from None


def print_resume_hint(workflow, layout: RunLayout) -> None:
    """The ``onerror`` hook: after a failed or interrupted run, what it keeps and that rerunning
    resumes (:func:`eagle3_pipeline.resume.kept_work`). Not after ``snakemake verify`` or
    ``snakemake plan`` alone: the first fails on altered files, which a rerun does not mend, the
    second on a run that would be refused at its start, which it has printed."""
    from .resume import kept_work

    if (targets := target_rules(workflow)) and targets <= {"verify", "plan"}:
        return
    try:
        kept = kept_work(layout.dir)
    except OSError as e:
        kept = [f"(could not list: {e})"]
    print(
        "\nThe run stopped before it finished. Rerun the same command to resume"
        + (": kept for the rerun,\n  " + "\n  ".join(kept) if kept else ".")
        + "\nWhere the error above names an input or a setting, fix it first: a rerun meets it again."
        + f"\nEach job's log is under {layout.log_dir}/ (Snakemake replaces a job's log when it reruns the job).",
        file=sys.stderr,
    )


def _declared_paths(files, wildcards: dict) -> dict[str, list[str]]:
    """``{name: [paths]}`` of a rule's declared input or output files (``rules.<name>.input``) for one
    job's ``wildcards``: input functions called, ``unpack()``ed ones giving named files of their own,
    unnamed files under the name ``""``."""
    wc = SimpleNamespace(**wildcards)

    def resolve(item):
        if callable(item):
            item = item(wc)
        items = [item] if isinstance(item, str) else list(item)
        return [str(x).format(**wildcards) for x in items]

    named = {name: resolve(item) for name, item in files.items()}
    listed = {id(v) for _, v in files.items()}
    for item in files:  # unpack()ed input functions: named files of their own
        if callable(item) and id(item) not in listed:
            got = item(wc)
            if isinstance(got, dict):
                named |= {name: resolve(path) for name, path in got.items()}
    if not named:  # unnamed: summarize_run's output, prepare_target_model's...
        unnamed = [p for item in files for p in resolve(item)]
        named = {"": unnamed} if unnamed else {}
    return named


def lineage_jobs(workflow, rules, targets: list[str], wildcard_values: dict[str, list[str]], sources) -> list[dict]:
    """Every job that makes ``targets``, as ``{rule, wildcards, inputs, outputs, sources}``, from the
    rules' declared files, so that the run manifest's graph is the workflow's graph.

    Walks back from ``targets`` (the run's final outputs) as Snakemake's DAG does, but from the
    rules alone (no DAG exists while input functions are evaluated): a job is in when another
    job in, or a target, reads one of its outputs. So a variant whose vocabulary is the run's
    has no vocabulary job, and the embedded target's job is there only when a job reads it. Jobs
    come in the order the rules are defined, a rule's jobs in the order of ``wildcard_values``.

    Args:
        workflow: the Snakemake ``Workflow`` (``workflow.rules``: its rules, in definition order).
        rules: the Snakefile's ``rules`` namespace (``rules.<name>.input``/``output`` without
            wildcard constraints).
        targets: the files the run makes.
        wildcard_values: every value of each wildcard (``{"shard": [...], "variant": [...]}``).
        sources: ``sources(stage, wildcards)``: the files outside the workflow a job of that
            stage (:func:`rule_stage`) reads, as source descriptions.
    """
    candidates = []
    for rule in workflow.rules:
        proxy = getattr(rules, rule.name)
        outputs = [str(f) for f in proxy.output]
        if not outputs:
            continue
        names = sorted({n for f in outputs for n in re.findall(r"\{(\w+)\}", f)})
        for values in itertools.product(*(wildcard_values[n] for n in names)):
            wc = dict(zip(names, values, strict=True))
            candidates.append((rule, proxy, wc, _declared_paths(proxy.output, wc)))
    needed, chosen = set(targets), {}
    while True:
        new = [i for i, (*_, outs) in enumerate(candidates) if i not in chosen and any(p in needed for ps in outs.values() for p in ps)]
        if not new:
            break
        for i in new:
            _rule, proxy, wc, _outs = candidates[i]
            chosen[i] = _declared_paths(proxy.input, wc)
            needed |= {p for ps in chosen[i].values() for p in ps}
    return [
        {"rule": rule.name, "wildcards": wc, "inputs": chosen[i], "outputs": outs, "sources": sources(rule_stage(rule), wc)}
        for i, (rule, _proxy, wc, outs) in enumerate(candidates)
        if i in chosen
    ]

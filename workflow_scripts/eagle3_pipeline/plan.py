"""Run planning: per stage, the work, the estimated time and the disk it will write.

Estimates are ``model load + tokens / throughput`` per stage. The throughput and load time
come, in this order of preference, from

1. this run's own finished outputs (trace summaries, hidden-state indexes, the training
   summary, the acceptance file: each records tokens/s and model load seconds), so a
   resumed or repeated run is planned from what this host measured; or
2. reference figures measured by this project (:data:`REFERENCES`, the one nearest the target in
   size), scaled to the target by
   its parameter count (full-model stages are compute bound: time per token ~ parameters)
   and, for training, by the drafter's hidden size squared.

Every estimate names its source. Token counts use this run's traces when they exist,
otherwise the configured prompt count and ``max_tokens`` with the completion fill measured
on the demo run (:data:`COMPLETION_FILL`).

Which jobs are pending comes from Snakemake's own DAG, never from which files exist, so a
rerun forced by changed parameters or code, by ``-R`` or by ``--forcerun`` is planned as
Snakemake will run it: :mod:`eagle3_pipeline.snakemake_adapter` (the one module that reads
Snakemake's internals) lists the jobs of the DAG a run has built (the ``onstart`` hook) or of a
dry-run (``snakemake plan``); this module only estimates. Each file it reads is named by the
run's layout (:class:`eagle3_pipeline.layout.RunLayout`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from .layout import RunLayout
from .target_model import BUILTIN_CONFIG

#: Each stage's output that records its work: (the layout's file of a job, tokens key, seconds key,
#: model load seconds key). A per-shard stage's file takes the job's shard.
STAGES = {
    "generate_traces": (RunLayout.trace_summary, "completion_tokens", "generate_seconds", "model_load_seconds"),
    "extract_hidden_states": (RunLayout.hidden_index, "num_tokens", "extract_seconds", "model_load_seconds"),
    "train_drafter": (RunLayout.train_summary, "tokens_seen", "seconds", None),  # compilation is inside its seconds
    "evaluate_drafter": (RunLayout.acceptance, "output_tokens", "seconds", "model_load_seconds"),
}
#: The stages with one job per shard (their files and benchmarks take the shard).
PER_SHARD = ("generate_traces", "extract_hidden_states")


def stage_file(lay: RunLayout, stage: str, wildcards: dict) -> str:
    """The file that records one job's work (:data:`STAGES`), in ``lay`` or, for a sweep variant's job
    (``{"variant": v}``), in ``lay.variant(v)``.

    Raises:
        KeyError: a per-shard stage's ``wildcards`` lack ``shard``.
    """
    lay = lay.of_job(wildcards)
    record = STAGES[stage][0]
    return record(lay, wildcards["shard"]) if stage in PER_SHARD else record(lay)


def stage_benchmark(lay: RunLayout, stage: str, wildcards: dict) -> str:
    """Snakemake's benchmark file of one job of ``stage`` (the rule's ``benchmark:``), a variant's
    under its layout as in :func:`stage_file`."""
    lay = lay.of_job(wildcards)
    return lay.benchmark(stage, wildcards["shard"]) if stage in PER_SHARD else lay.benchmark(stage)


def job_stage(job: dict) -> str:
    """The stage a job (:func:`eagle3_pipeline.snakemake_adapter.needrun_jobs`) belongs to: its
    ``stage`` (the rule whose script it runs: a sweep variant's training is a ``train_drafter``
    job), or its rule."""
    return job.get("stage") or job["rule"]


def load_references(path: str | Path | None = None, section: str = "platforms") -> dict:
    """The measured reference figures (``references.json`` beside this module: each figure with its
    source and the command that measured it): section ``platforms``, ``{platform: [reference,
    ...]}``, or ``workload``, ``{name: {"value": ..., "source": ..., "command": ...}}``."""
    path = Path(path) if path else Path(__file__).with_name("references.json")
    return json.loads(path.read_text(encoding="utf-8"))[section]


#: Reference throughputs (tokens/s, load s) per platform and target, with where and how they were
#: measured (``references.json``). A plan uses the platform's reference nearest the target in
#: parameter count (:func:`reference_for`).
REFERENCES = load_references()


def reference_for(platform: str, params: int, amx: bool | None = None) -> dict:
    """The reference figures of ``platform`` measured on the target nearest ``params`` in size.

    Nearest is the smallest ``|log(reference params / params)|``, so a 1B target is planned
    from SmolLM2-135M's figures on a GPU and a 3B target from the 8B shape's. ``amx``: whether
    this CPU has AMX tiles (:func:`eagle3_pipeline.precision.cpu_has_amx`); CPU references
    measured on a CPU of the same kind (their ``amx``) are preferred, where there are any.

    Raises:
        KeyError: an unknown platform.
    """
    import math

    refs = REFERENCES[platform]
    same_kind = [r for r in refs if amx is not None and r.get("amx") == amx]
    return min(same_kind or refs, key=lambda r: abs(math.log(r["params"] / max(params, 1))))


#: The token counts per prompt a plan assumes before its run has traces, each with where and
#: how it was measured (``references.json``'s ``workload``).
WORKLOAD = load_references(section="workload")
#: Completion tokens per prompt as a fraction of ``max_tokens``, for generation's answers and for
#: the evaluation's (the demo run).
COMPLETION_FILL = WORKLOAD["completion_fill"]["value"]
#: Templated prompt tokens per ShareGPT prompt by ``prompts.turns`` (``first``, ``multi``,
#: ``each``): a multi-turn prompt carries its history.
PROMPT_TOKENS_BY_TURNS = WORKLOAD["prompt_tokens_by_turns"]["value"]
#: Prompts of the default prompt set (the built-in ShareGPT, every prompt) by ``prompts.turns``:
#: what ``prompts.max_prompts: null`` is planned for before prepare_prompts has counted them.
SHAREGPT_PROMPTS_BY_TURNS = WORKLOAD["sharegpt_prompts_by_turns"]["value"]
PROMPT_TOKENS = PROMPT_TOKENS_BY_TURNS["first"]


@dataclass
class StageEstimate:
    """One stage of the plan. Seconds are wall-clock estimates; bytes are what it writes.

    ``jobs`` is the stage's job count in the run (one per shard for generation and
    extraction); ``pending`` the wildcards of the jobs Snakemake will run (``{"shard":
    "00001"}``, ``{}`` for a job without wildcards). ``tokens``, ``seconds`` and
    ``disk_bytes`` cover the pending jobs, or every job of a stage that is ``done`` (what
    rerunning it would take).
    """

    stage: str
    jobs: int
    tokens: int
    seconds: float
    load_seconds: float
    tokens_per_second: float
    disk_bytes: int
    source: str
    done: bool = False
    work: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _stage_files(lay: RunLayout, stage: str) -> list[Path]:
    """The finished files of ``stage``'s jobs in ``lay`` (every shard's of a per-shard stage)."""
    rel = Path(lay.relative(stage_file(lay, stage, {"shard": "*"})))
    return sorted(Path(lay.dir).glob(rel.as_posix()))


#: MT-Bench's first turns (``evaluation.prompts: {type: builtin_mtbench}``).
MTBENCH_PROMPTS = 80


def eval_prompt_count(cfg: dict) -> tuple[int, str]:
    """The prompts one evaluation decodes (each to ``evaluation.max_tokens``), and where the count comes from.

    The source's questions (MT-Bench's 80, or the non-blank lines of ``evaluation.prompts.path``;
    80 where that file cannot be read yet), cut to ``evaluation.max_prompts`` as
    prepare_eval_prompts cuts them: a ``max_prompts`` above the source's count plans the source's.
    """
    source, cap = cfg["evaluation"]["prompts"], cfg["evaluation"].get("max_prompts")
    if source["type"] == "builtin_mtbench":
        n, src = MTBENCH_PROMPTS, "MT-Bench's 80 first turns"
    else:
        try:
            with open(source["path"], "rb") as f:
                n = sum(1 for line in f if line.strip())
            src = f"the {n} questions of {source['path']}"
        except OSError:
            n, src = MTBENCH_PROMPTS, f"80 ({source['path']} not readable yet)"
    if cap is not None and cap < n:
        return cap, f"evaluation.max_prompts ({src} cut to {cap})"
    return n, src


def _positive(x, allow_zero: bool = False) -> bool:
    """A finite int or float above 0 (or at 0 with ``allow_zero``), not a bool."""
    import math

    ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
    return ok and (x >= 0 if allow_zero else x > 0)


def measured(run_dir: str | Path, bench_dir: str | Path | None = None) -> dict:
    """Throughput and fixed seconds measured by this run's finished outputs, per stage.

    Args:
        run_dir: ``results/<run>``.
        bench_dir: the run's :attr:`RunLayout.bench_dir`, where Snakemake's ``benchmark:`` files
            give each job's whole wall time; None reads none.

    Returns:
        ``{stage: {"tokens_per_second", "load_seconds", "source"}}`` for the stages that have
        finished outputs with timings (none for a fresh run). ``tokens_per_second``: the
        stage's tokens over its jobs' work seconds. ``load_seconds``: the largest of its jobs'
        fixed seconds, as the references count them (``references.json``): a job's wall time
        beyond its work seconds (start-up, model load, shutdown; for the evaluation, beyond its
        speedup measurement too) where its benchmark is in ``bench_dir``, else the model load
        its output records.
    """
    lay = RunLayout.at(run_dir)
    bench = RunLayout.at(run_dir, bench_dir) if bench_dir is not None else None
    out: dict = {}

    def num(r: dict, k: str | None) -> float:
        v = r.get(k) if k else 0.0
        if not _positive(v, allow_zero=True):  # a negative, infinite or non-numeric figure plans nothing
            raise TypeError(k)
        return float(v)

    for stage, (_file, tok_key, sec_key, load_key) in STAGES.items():
        files = _stage_files(lay, stage)
        recs = []
        for f in files:  # a file without usable numbers is left out, not an error
            r = _read(f)
            try:
                tokens, seconds, load = num(r, tok_key), num(r, sec_key), num(r, load_key)
            except (TypeError, AttributeError):
                continue
            wall = _bench_seconds(Path(stage_benchmark(bench, stage, _wildcards_of(lay, stage, f)))) if bench else None
            if wall is not None:
                load = max(wall - seconds - _speedup_seconds(r, load), 0.0)
            recs.append((tokens, seconds, load))
        recs = [x for x in recs if x[0] > 0 and x[1] > 0]
        if recs:
            out[stage] = {
                "tokens_per_second": sum(x[0] for x in recs) / sum(x[1] for x in recs),
                "load_seconds": max(x[2] for x in recs),
                "source": f"measured: {len(recs)} file(s) like {files[0]}",
            }
    return out


def _wildcards_of(lay: RunLayout, stage: str, path: Path) -> dict:
    """The wildcards of the job of ``stage`` whose record (:func:`stage_file`) is ``path``, one of
    :func:`_stage_files`: ``{"shard": "NNNNN"}`` for a per-shard stage, else ``{}``."""
    if stage not in PER_SHARD:
        return {}
    head, tail = Path(stage_file(lay, stage, {"shard": "\0"})).name.split("\0")
    return {"shard": path.name[len(head) : len(path.name) - len(tail)]}


def _speedup_seconds(rec: dict, load: float) -> float:
    """Seconds an evaluation's record ``rec`` (``eval/acceptance.json``) spent on its speedup
    measurement, as :func:`speedup_estimate` plans them: each row's decoding with and without
    the drafter, and one more engine start (its ``model_load_seconds``, ``load``); 0 for other
    stages' records and an evaluation without rows."""
    rows = rec.get("speedup") if isinstance(rec, dict) else None
    if not isinstance(rows, list) or not rows:
        return 0.0
    side_seconds = [
        row[side].get("seconds") for row in rows if isinstance(row, dict) for side in SPEEDUP_SIDES if isinstance(row.get(side), dict)
    ]
    return load + sum(x for x in side_seconds if _positive(x))


#: The two sides of a speedup measurement (``eval/acceptance.json``'s ``speedup`` rows).
SPEEDUP_SIDES = ("with_drafter", "without_drafter")


def measured_speedup(run_dir: str | Path) -> tuple[dict | None, str | None]:
    """Decoding throughput this run's finished evaluation measured per concurrency.

    A ``speedup`` row is used when its ``concurrency`` is an integer >= 1 and both of its runs
    (``with_drafter``, ``without_drafter``) have positive, finite ``output_tokens`` and
    ``seconds``; the others are left out and counted.

    Returns:
        ``(figures, note)``: ``figures`` is ``{"with_drafter": {c: tok/s}, "without_drafter": {c: tok/s},
        "load_seconds", "source"}`` from ``eval/acceptance.json`` (output tokens / seconds of
        each run; its engine's ``model_load_seconds`` for the target-alone engine, which loads
        as long), or None; ``note`` says why the file's rows were not (all) used, naming it, or is
        None (no file: a fresh run; or every row used).
    """
    lay = RunLayout.at(run_dir)
    path = Path(lay.acceptance())
    if not path.is_file():
        return None, None
    rec = _read(path)
    if not isinstance(rec, dict):
        return None, f"{path} is not a JSON object: not used"
    rows = rec.get("speedup")
    if not isinstance(rows, list) or not rows:
        return None, None  # the measurement was not asked for (or not yet made)
    figures: dict = {side: {} for side in SPEEDUP_SIDES}
    bad = 0
    for row in rows:
        try:
            c = row["concurrency"]
            runs = [row[side] for side in SPEEDUP_SIDES]
            usable = isinstance(c, int) and not isinstance(c, bool) and c >= 1
            usable = usable and all(_positive(r["output_tokens"]) and _positive(r["seconds"]) for r in runs)
        except (KeyError, TypeError):
            usable = False
        if not usable:
            bad += 1
            continue
        for side, r in zip(SPEEDUP_SIDES, runs, strict=True):
            figures[side][c] = r["output_tokens"] / r["seconds"]
    load = rec.get("model_load_seconds")
    why = f"{bad} of {len(rows)} speedup rows without a concurrency >= 1 and positive output_tokens and seconds" if bad else ""
    if not _positive(load, allow_zero=True):
        why = "; ".join(x for x in (why, f"model_load_seconds {load!r} is not a number >= 0") if x)
    if not figures["with_drafter"] or not _positive(load, allow_zero=True):
        return None, f"{path}: {why}: not used"
    note = f"{path}: {why}: left out" if why else None
    return figures | {"load_seconds": float(load), "source": f"measured: {path}"}, note


def throughput_at(figures: dict[int, float], concurrency: int) -> tuple[float, bool]:
    """Decoding tokens/s at ``concurrency`` requests in flight from figures measured at others.

    Between two measured concurrencies, log-log interpolation (throughput as a power of the
    concurrency between them); outside them, the nearest figure, which for a higher concurrency
    understates the throughput (overstates the time).

    Args:
        figures: ``{concurrency: tokens/s}``, at least one.
        concurrency: requests in flight.

    Returns:
        (tokens/s, whether ``concurrency`` lay outside the measured ones).
    """
    import math

    cs = sorted(figures)
    if concurrency in figures:
        return figures[concurrency], False
    if concurrency < cs[0] or concurrency > cs[-1]:
        return figures[cs[0] if concurrency < cs[0] else cs[-1]], True
    lo = max(c for c in cs if c < concurrency)
    hi = min(c for c in cs if c > concurrency)
    t = (math.log(concurrency) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp(math.log(figures[lo]) * (1 - t) + math.log(figures[hi]) * t), False


def speedup_estimate(cfg: dict, eval_prompts: int, figures: dict | None, scale: float = 1.0) -> dict:
    """Seconds the evaluation spends measuring the speedup (``evaluation.speedup``): every
    concurrency decoded with the drafter and then by the target alone, in an engine of its own.

    Args:
        cfg: the run's (or a sweep variant's) validated config.
        eval_prompts: the prompts one evaluation decodes (:func:`eval_prompt_count`).
        figures: :func:`measured_speedup`'s form (a reference's ``evaluate_drafter_speedup`` or
            this run's measurement), or None where there is none.
        scale: throughput factor for a target of another size than the figures' (as the plan
            scales the other stages).

    Returns:
        ``{"seconds", "tokens", "source"}``: ``tokens`` decoded per side and concurrency (the first
        ``speedup.max_prompts`` prompts x ``evaluation.max_tokens``); ``seconds`` 0 with a source
        saying why where nothing is measured (``concurrency: []``) or no figures exist.
    """
    speed = cfg["evaluation"]["speedup"]
    n = min(speed["max_prompts"] or eval_prompts, eval_prompts)
    tokens = n * cfg["evaluation"]["max_tokens"]
    if not speed["concurrency"]:
        return {"seconds": 0.0, "tokens": 0, "source": "evaluation.speedup.concurrency: [] (not measured)"}
    if not figures:
        return {
            "seconds": 0.0,
            "tokens": tokens,
            "source": "no decoding figures for this platform: the speedup measurement is not in the estimate",
        }
    seconds, outside = figures["load_seconds"], []
    for c in speed["concurrency"]:
        for side in SPEEDUP_SIDES:
            tps, out = throughput_at(figures[side], c)
            seconds += tokens / (tps * scale)
            if out and c not in outside:
                outside.append(c)
    src = figures["source"] + (f"; {outside} in flight taken from the nearest measured concurrency" if outside else "")
    return {"seconds": round(seconds, 1), "tokens": tokens, "source": src}


def make_plan(
    cfg: dict, target: dict, run_dir: str | Path, platform: str, bench_dir: str | Path | None = None, amx: bool | None = None
) -> list[StageEstimate]:
    """The plan of a run: one :class:`StageEstimate` per full-model or training stage.

    Args:
        cfg: the validated config.
        target: ``{"params", "num_hidden_layers", "hidden_size"}`` of the target, and
            optionally ``"total_params"``: ``params`` are those one token runs through (the
            active ones of a mixture of experts), which set the full-model stages' speed;
            ``total_params`` every weight, which sets loading time (default ``params``); both
            as :func:`estimate_params` counts them.
        run_dir: ``results/<run>`` (measured throughputs and this run's token counts are read
            there; which stages are pending, :func:`plan_run` decides from Snakemake's jobs).
        platform: which reference figures apply (:data:`REFERENCES`): ``"cuda"``, ``"cpu"`` (a
            CPU with fast bf16) or ``"cpu_fp32"`` (one without, computing in float32).
        bench_dir: the run's :attr:`RunLayout.bench_dir`: finished jobs' wall times, for the
            fixed seconds of the stages this run has measured (:func:`measured`); None leaves
            them at the model load their outputs record.
        amx: as for :func:`reference_for`.

    Raises:
        KeyError: an unknown platform.
    """
    from .conventions import resolve_layer_ids

    lay = RunLayout.at(run_dir)
    ref = reference_for(platform, target["params"], amx)
    got = measured(run_dir, bench_dir)
    prompts_summary = _read(Path(lay.prompt_summary()))
    traces = [
        r
        for r in map(_read, _stage_files(lay, "generate_traces"))
        if isinstance(r, dict) and all(isinstance(r.get(k), int) for k in ("ok", "prompt_tokens", "completion_tokens"))
    ]
    kept = prompts_summary.get("kept") if isinstance(prompts_summary, dict) else None
    prompts_summary = prompts_summary if isinstance(kept, int) else None
    n_prompts = kept if prompts_summary else cfg["prompts"]["max_prompts"]
    src_prompts = "prompts/summary.json" if prompts_summary else "prompts.max_prompts"
    if n_prompts is None:
        turns = cfg["prompts"]["turns"]
        n_prompts = SHAREGPT_PROMPTS_BY_TURNS[turns]
        src_prompts = (
            f"every prompt of the built-in ShareGPT with turns: {turns} ({n_prompts:,}; set prompts.max_prompts for a sharper plan)"
        )
    if traces:
        ok = sum(t["ok"] for t in traces)
        p_tok = sum(t["prompt_tokens"] for t in traces) / max(ok, 1)
        c_tok = sum(t["completion_tokens"] for t in traces) / max(ok, 1)
        n_ok, tok_src = ok, "this run's traces"
    else:
        p_tok = PROMPT_TOKENS_BY_TURNS[cfg["prompts"]["turns"]]
        # a request's max_tokens is lowered to the room its prompt leaves (generation's _requests)
        c_tok = COMPLETION_FILL * min(cfg["generation"]["max_tokens"], max(cfg["max_seq_len"] - p_tok, 1))
        answers = cfg["generation"]["answers_per_prompt"]
        n_ok, tok_src = (
            n_prompts * answers,
            f"{p_tok} prompt tokens ({cfg['prompts']['turns']} turns) + {COMPLETION_FILL:.0%} of max_tokens per answer (demo run)"
            + (f", {answers} answers per prompt" if answers > 1 else ""),
        )
    ratio = ref["params"] / max(target["params"], 1)
    # time per token ~ parameters for a big target; a smaller one gains less on a GPU (measured: the
    # hf backend on an H200 was 9.5x faster for SmolLM2 than for the 8B shape, 60x fewer parameters)
    cpu = platform.startswith("cpu")
    scale = ratio if cpu or ratio < 1 else ratio**0.5
    train_scale = (ref["hidden_size"] / target["hidden_size"]) ** 2
    # loading reads every weight, experts a token does not use included
    load_scale = max(1.0, target.get("total_params", target["params"]) / ref["params"])
    replicas = {
        "generate_traces": cfg["vllm"]["data_parallel_size"],
        "extract_hidden_states": cfg["extraction"].get("data_parallel_size") or cfg["vllm"]["data_parallel_size"],
    }
    shards = cfg["prompts"]["num_shards"]
    engine_gpus = cfg["vllm"]["tensor_parallel_size"] * cfg["vllm"]["pipeline_parallel_size"]
    backend = cfg["extraction"]["backend"]
    ext_key = f"extract_hidden_states_{backend}" if f"extract_hidden_states_{backend}" in ref else None

    def rate(stage: str, ref_key: str | None = None, s: float = scale) -> tuple[float, float, str]:
        if stage in got:
            m = got[stage]
            return m["tokens_per_second"], m["load_seconds"], m["source"]
        r = ref[ref_key or stage]
        d_ = replicas.get(stage, 1)
        note = "" if round(s, 3) == 1 else f" x {s:.3g}"
        note += f" x {d_} replicas" if d_ > 1 else ""
        # caveats where they apply: a GPU figure scaled to another size, parallelism the reference did not have
        caveats = ["scaled from another target size"] if not cpu and round(s, 3) != 1 else []
        caveats += ["tensor/pipeline parallel not modelled"] if engine_gpus > 1 else []
        shared = not cpu and d_ > 1 and cfg["vllm"]["replicas_per_gpu"] > 1 and (stage == "generate_traces" or backend == "vllm")
        caveats += [f"replicas scaled linearly{', sharing GPUs' if shared else ''}"] if d_ > 1 else []
        note += f"; rough: {', '.join(caveats)}" if caveats else ""
        # the engines of one GPU start one after another (parallel.engine_turn)
        starts = min(cfg["vllm"]["replicas_per_gpu"], d_) if shared else 1
        return (
            r["tokens_per_second"] * s * d_,
            r["load_seconds"] * (load_scale if stage != "train_drafter" else 1.0) * starts,
            f"reference ({r.get('source', ref['source'])}){note}",
        )

    _aux, layers = resolve_layer_ids(cfg["extraction"]["aux_layer_ids"], target["num_hidden_layers"])
    dtype = cfg["extraction"]["storage_dtype"]
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}[dtype]
    per_token = len(layers) * target["hidden_size"] * itemsize + (4 * len(layers) if dtype == "float8_e4m3fn" else 0)
    gen_tokens = int(n_prompts * cfg["generation"]["answers_per_prompt"] * c_tok)
    ext_tokens = int(n_ok * (p_tok + c_tok))
    epochs = cfg["training"]["epochs"]
    train_fraction = 1.0 - cfg["training"]["val_fraction"]
    eval_prompts, eval_src = eval_prompt_count(cfg)
    # answers end before max_tokens as generation's do (demo run: 16,944 / 80 / 256 = 0.83)
    eval_tokens = int(eval_prompts * COMPLETION_FILL * cfg["evaluation"]["max_tokens"])
    # sweep variants: more trainings (those with a drafter of their own) and evaluations, each
    # planned like the run's own
    from .sweep import shares_drafter, variant_configs  # here: estimate_params needs no config schema (jsonschema)

    variants = variant_configs(cfg) if cfg.get("sweep", {}).get("variants") else {}
    n_train = 1 + sum(not shares_drafter(cfg, v) for v in variants.values())
    n_eval = 1 + len(variants)
    # the evaluation's second part: decoding with and without the drafter per concurrency, in every
    # evaluation job (each variant's with its own evaluation settings)
    (speed_figures, speed_note), speed_scale = measured_speedup(run_dir), 1.0
    if speed_figures is None and "evaluate_drafter_speedup" in ref:  # keys: requests in flight, as JSON strings
        r = ref["evaluate_drafter_speedup"]
        speed_figures = r | {side: {int(c): v for c, v in r[side].items()} for side in SPEEDUP_SIDES}
        speed_figures["source"] = f"reference ({r['source']})" + (f" x {scale:.3g}" if round(scale, 3) != 1 else "")
        speed_scale = scale
    if speed_note and speed_figures is not None:  # this run's file was (partly) unusable: said where it applies
        speed_figures = speed_figures | {"source": f"{speed_figures['source']} ({speed_note})"}
    speedups = [speedup_estimate(c, eval_prompts, speed_figures, speed_scale) for c in (cfg, *variants.values())]
    if speed_note and speed_figures is None:
        speedups[0]["source"] += f" ({speed_note})"
    plan = []
    for stage, jobs, tokens, ref_key, s, disk, work in (
        ("generate_traces", shards, gen_tokens, None, scale, 0, {"prompts": n_prompts, "prompts_source": src_prompts}),
        (
            "extract_hidden_states",
            shards,
            ext_tokens,
            ext_key,
            scale,
            ext_tokens * per_token,
            {"samples": n_ok, "layers": layers, "bytes_per_token": per_token, "storage_dtype": dtype},
        ),
        ("train_drafter", n_train, int(ext_tokens * epochs * train_fraction) * n_train, None, train_scale, 0, {"epochs": epochs}),
        (
            "evaluate_drafter",
            n_eval,
            eval_tokens * n_eval,
            None,
            scale,
            0,
            {
                "max_tokens": cfg["evaluation"]["max_tokens"],
                "tokens_source": f"{eval_src} x {COMPLETION_FILL:.0%} of max_tokens",
                "speedup_seconds": round(sum(x["seconds"] for x in speedups), 1),
                "speedup_source": speedups[0]["source"],
            },
        ),
    ):
        tps, load, source = rate(stage, ref_key, s)
        if stage == "train_drafter" and platform == "cpu_fp32" and cfg["training"]["optimizer"] == "muon":
            # docs/gpus-and-nodes.md "Compute dtypes": torch's Muon keeps its Newton-Schulz steps in bf16
            source += (
                "; Muon's bf16 steps are emulated on this CPU (2/3 of a step on the reference's): training.optimizer adamw avoids them"
            )
        per_job = tokens / max(jobs, 1)
        seconds = load + per_job / tps  # jobs of one stage run one after another on one host
        # (training's load is its compilation, once per training job like an engine's load)
        extra = work.get("speedup_seconds", 0.0)  # every evaluation job's speedup measurement
        if stage == "evaluate_drafter" and cfg["evaluation"]["speedup"]["concurrency"]:
            source += f"; speedup measurement {extra:.0f} s: {work['speedup_source']}"
        plan.append(
            StageEstimate(
                stage,
                jobs,
                tokens,
                round(seconds * jobs + extra, 1),
                load,
                round(tps, 1),
                int(disk),
                source,
                work={"tokens_source": tok_src} | work,
            )
        )
    return plan


def estimate_params(text_config, active: bool = False) -> int:
    """Parameter count of a decoder from its config: embeddings, attention, MLP, norms, head.

    Attention is grouped-query (``2 h·heads·d + 2 h·kv`` with ``kv`` = key/value heads × head
    dim) or DeepSeek's multi-head latent attention where the config has ``kv_lora_rank`` (the
    query's and the key/value's low-rank projections, their norms, the output projection).
    The MLP is gated (``3 h i``), or a mixture of experts where the config names its experts
    (``num_experts`` (Qwen-MoE), ``n_routed_experts`` (DeepSeek), ``num_local_experts``
    (Mixtral, gpt-oss)): a router, ``E`` experts of ``3 h i_e`` (``moe_intermediate_size``, else
    ``intermediate_size``) and DeepSeek's shared experts, with DeepSeek's first
    ``first_k_dense_replace`` layers and Qwen's ``mlp_only_layers`` dense. Gemma-4's per-layer
    head sizes and per-layer inputs are counted too.

    Args:
        text_config: the target's (text) config.
        active: count only what one token runs through: ``num_experts_per_tok`` of the ``E``
            experts (compute per token, which sets the full-model stages' speed); else every
            weight (what loading reads).

    Returns:
        the count; exact for Llama, Qwen3, Qwen3-MoE and DeepSeek-V3 configs (tests), an
        estimate for other shapes (biases, extra norms are left out).
    """
    c = text_config
    h, L, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    norms = 2 * h  # input and post-attention RMSNorm
    if getattr(c, "kv_lora_rank", None):
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q_rank = getattr(c, "q_lora_rank", None)
        q = (h * q_rank + q_rank + q_rank * heads * qk) if q_rank else h * heads * qk
        kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        attn = L * (q + kv + heads * c.v_head_dim * h)
    else:
        head_dims = _head_dims(c, h // heads)
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        qk_norms = 2 if getattr(c, "model_type", "").startswith(("qwen3", "gemma4")) else 0  # q_norm, k_norm
        attn = sum(2 * h * heads * d + 2 * h * kv_heads * d + qk_norms * d for d in head_dims)
    dense_mlp = 3 * h * getattr(c, "intermediate_size", 4 * h)
    experts = next((getattr(c, k) for k in ("num_experts", "n_routed_experts", "num_local_experts") if getattr(c, k, None)), 0)
    if experts:
        i_e = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        used = c.num_experts_per_tok if active else experts
        moe_mlp = h * experts + used * 3 * h * i_e + (getattr(c, "n_shared_experts", None) or 0) * 3 * h * i_e
        if getattr(c, "topk_method", None) == "noaux_tc":
            moe_mlp += experts  # the router's score-correction bias
        step = getattr(c, "decoder_sparse_step", 1) or 1
        dense = set(getattr(c, "mlp_only_layers", None) or []) | set(range(getattr(c, "first_k_dense_replace", 0) or 0))
        sparse = [j for j in range(L) if j not in dense and (j + 1) % step == 0]
        mlp = len(sparse) * moe_mlp + (L - len(sparse)) * dense_mlp
    else:
        mlp = L * dense_mlp
    tied = getattr(c, "tie_word_embeddings", False)
    # Gemma-3n/4's per-layer inputs of width w: a table of vocab_size_per_layer_input x (L x w), the
    # model's projection to them (h x L w) and each layer's gate and projection (2 h w)
    w = getattr(c, "hidden_size_per_layer_input", None) or 0
    per_layer = ((getattr(c, "vocab_size_per_layer_input", None) or 0) * L * w + h * L * w + L * 2 * h * w) if w else 0
    return attn + L * norms + mlp + v * h * (1 if tied else 2) + h + per_layer


def _head_dims(c, default: int) -> list[int]:
    """The attention head size of each layer: ``head_dim``, or a layer's own in configs with
    per-layer attributes (Gemma-4's ``per_layer_config``: 512 in its full-attention layers)."""
    head_dim = getattr(c, "head_dim", None) or default
    per_layer = getattr(c, "per_layer_config", None)  # transformers' view: per_layer_config[j].head_dim
    if per_layer is None:
        return [int(head_dim)] * c.num_hidden_layers
    return [int(getattr(per_layer[j], "head_dim", None) or head_dim) for j in range(c.num_hidden_layers)]


def format_plan(plan: list[StageEstimate], jobs: list[dict] | None = None) -> str:
    """The plan as a fixed-width text table (hours, minutes, GB), one line per stage, a total,
    and, given ``jobs`` (:func:`eagle3_pipeline.snakemake_adapter.needrun_jobs`), a line with every job Snakemake will run by rule.
    A stage's ``jobs`` column reads ``pending/all`` when only some of its jobs are pending."""

    def hm(s: float) -> str:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{s / 60:.1f} min"

    notes: list[str] = []
    lines = [f"{'stage':24} {'jobs':>5} {'tokens':>12} {'tok/s':>9} {'load s':>7} {'time':>9} {'disk':>9}  source"]
    for p in plan:
        n = f"{len(p.pending)}/{p.jobs}" if p.pending and len(p.pending) < p.jobs else str(p.jobs)
        lines.append(
            f"{p.stage:24} {n:>5} {p.tokens:>12,} {p.tokens_per_second:>9,.0f} {p.load_seconds:>7.0f} {hm(p.seconds):>9} "
            f"{p.disk_bytes / 1e9:>7.2f}GB  {'done; ' if p.done else ''}{_footnoted(p.source, notes)}"
        )
    todo = [p for p in plan if not p.done]
    lines.append(
        f"{'total (pending stages)':24} {'':>5} {'':>12} {'':>9} {'':>7} {hm(sum(p.seconds for p in todo)):>9} {sum(p.disk_bytes for p in todo) / 1e9:>7.2f}GB"
    )
    lines += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    if jobs is not None:
        counts = jobs_by_rule(jobs)
        lines.append(f"Snakemake will run {len(jobs)} job(s): " + (", ".join(f"{r} x{n}" for r, n in counts.items()) or "none"))
    return "\n".join(lines)


def _footnoted(text: str, notes: list[str], longest: int = 60) -> str:
    """``text`` with each parenthesised part longer than ``longest`` characters (nesting counted,
    the outermost replaced) as a marker ``[n]`` into ``notes``, where it is added once: a source
    that several stages share is printed once under the table instead of on every line."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            if depth == 0:
                start = i
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
            if depth == 0:
                inner = text[start + 1 : i]
                if len(inner) > longest:
                    if inner not in notes:
                        notes.append(inner)
                    out.append(f"[{notes.index(inner) + 1}]")
                else:
                    out.append(text[start : i + 1])
        elif depth == 0:
            out.append(ch)
    if depth:  # unbalanced: the rest as written
        out.append(text[start:])
    return "".join(out)


def plan_dict(plan: list[StageEstimate], platform: str, jobs: list[dict] | None = None, kind: str = "preview") -> dict:
    """JSON form of a plan: ``kind`` ``"start"`` (kept by a run as it starts, :meth:`RunLayout.start_plan`)
    or ``"preview"`` (``snakemake plan``'s ``plan.json``), the UTC time it was made, the stages,
    the pending jobs by rule and the total estimated seconds of the pending stages."""
    return {
        "kind": kind,
        "made_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform,
        "stages": [asdict(p) for p in plan],
        "jobs": jobs_by_rule(jobs or []),
        "total_seconds": sum(p.seconds for p in plan if not p.done),
    }


def start_plans(run_dir: str | Path) -> list[Path]:
    """The start plans a run directory keeps (:meth:`RunLayout.start_plan`), oldest first."""
    return RunLayout.at(run_dir).start_plans()


#: The embedded target's shape as a plan reads it (:data:`eagle3_pipeline.target_model.BUILTIN_CONFIG`),
#: for plans made before it is materialized.
BUILTIN_SHAPE = {k: BUILTIN_CONFIG[k] for k in ("params", "num_hidden_layers", "hidden_size")}


def plan_run(
    cfg: dict,
    target_dir: str | Path | None,
    run_dir: str | Path,
    jobs: list[dict],
    platform: str | None = None,
    bench_dir: str | Path | None = None,
    amx: bool | None = None,
) -> tuple[list[StageEstimate], str]:
    """Plan a workflow run: :func:`make_plan` with the target's shape and the platform found here,
    restricted to the jobs Snakemake will run.

    Args:
        target_dir: the target model directory, or None for the embedded target not yet
            materialized (its known shape is used).
        jobs: the jobs Snakemake will run, as :func:`eagle3_pipeline.snakemake_adapter.needrun_jobs` or
            :func:`~eagle3_pipeline.snakemake_adapter.dry_run_jobs`
            return them (``{"rule", "stage", "wildcards", "input", "output"}``; :func:`job_stage`).
        platform: ``"cuda"``, ``"cpu"`` or ``"cpu_fp32"``; None: ``"cuda"`` when this machine sees
            an NVIDIA GPU (:func:`eagle3_pipeline.parallel.visible_gpus`), else ``"cpu"`` where
            the CPU has fast bf16 and ``"cpu_fp32"`` where it has not
            (:func:`eagle3_pipeline.precision.cpu_has_fast_bf16`).
        bench_dir: as for :func:`make_plan`.
        amx: as for :func:`reference_for`; when ``platform`` is None and this machine is a CPU
            one, found here (:func:`eagle3_pipeline.precision.cpu_has_amx`). A given
            ``platform`` plans for another machine, whose CPU this one's does not tell.

    Returns:
        ``(stages, platform)``; a stage none of whose jobs is in ``jobs`` is marked ``done``,
        and a stage with some of its jobs pending is estimated for those jobs only.
    """
    from .parallel import visible_gpus

    if platform is None:
        from .precision import cpu_has_amx, cpu_has_fast_bf16

        platform = "cuda" if visible_gpus() else "cpu" if cpu_has_fast_bf16() else "cpu_fp32"
        amx = cpu_has_amx() if platform != "cuda" and amx is None else amx
    if target_dir is not None and (Path(target_dir) / "config.json").is_file():
        from .target_model import text_config

        tc = text_config(target_dir, cfg["target"]["trust_remote_code"])
        target = {
            "params": estimate_params(tc, active=True),  # compute per token
            "total_params": estimate_params(tc),  # what loading reads
            "num_hidden_layers": tc.num_hidden_layers,
            "hidden_size": tc.hidden_size,
        }
    else:
        target = BUILTIN_SHAPE
    stages = make_plan(cfg, target, run_dir, platform, bench_dir, amx)
    for st in stages:
        st.pending = [j["wildcards"] for j in jobs if job_stage(j) == st.stage]
        st.done = not st.pending
        if st.pending and len(st.pending) < st.jobs:  # a resumed stage: only its pending jobs
            frac = len(st.pending) / st.jobs
            st.tokens, st.disk_bytes, st.seconds = int(st.tokens * frac), int(st.disk_bytes * frac), round(st.seconds * frac, 1)
        # a checkpoint applies only to the same shards and vocabulary: none when they are remade
        if st.stage == "train_drafter" and st.pending and not remakes_training_inputs(jobs):
            _resume_from_checkpoints(st, run_dir)
    return stages, platform


def remakes_training_inputs(jobs: list[dict]) -> bool:
    """Whether a job of ``jobs`` writes a file that a training job of ``jobs`` reads (hidden-state
    shards, a vocabulary, the materialized target), from the jobs' ``input`` and ``output``: a
    training's checkpoint then no longer applies. A job further up (new prompts, traces) always
    comes with such a job: Snakemake reruns what depends on a rerun job."""
    read = {f for j in jobs if job_stage(j) == "train_drafter" for f in j.get("input", ())}
    return any(f in read for j in jobs if job_stage(j) != "train_drafter" for f in j.get("output", ()))


def training_checkpoint_step(run_dir: str | Path, wildcards: dict) -> tuple[int, int] | None:
    """``(step, total_steps)`` of the training checkpoint a pending training job would resume from.

    The run's own training (no wildcards) keeps it in ``train/.checkpoint/progress.json``, a
    sweep variant's (``{"variant": v}``) in ``sweep/<v>/train/.checkpoint/progress.json``
    (:class:`eagle3_pipeline.training.TrainCheckpoint`). None when there is none or it is
    unreadable. Whether the checkpoint still applies (same inputs and settings), only the
    training job decides: :func:`plan_run` ignores checkpoints when a rule of
    :func:`remakes_training_inputs`, and a changed training setting (which reruns
    nothing upstream) still makes the plan too short.
    """
    from .resume import checkpoint_progress

    lay = RunLayout.at(run_dir)
    lay = lay.of_job(wildcards)
    return checkpoint_progress(lay.train_checkpoint())


def _resume_from_checkpoints(st: StageEstimate, run_dir: str | Path) -> None:
    """Estimate the pending trainings of ``st`` for the steps left after their checkpoints."""
    per_job = st.tokens / len(st.pending)
    left = []
    for w in st.pending:
        ck = training_checkpoint_step(run_dir, w)
        left.append(1.0 - ck[0] / ck[1] if ck else 1.0)
        if ck:
            st.work.setdefault("resumes_from", []).append({**w, "step": ck[0], "total_steps": ck[1]})
    if "resumes_from" not in st.work:
        return
    st.tokens = int(sum(per_job * f for f in left))
    st.seconds = round(sum(st.load_seconds + per_job * f / max(st.tokens_per_second, 1e-9) for f in left), 1)
    steps = ", ".join(f"{r['step']}/{r['total_steps']}" for r in st.work["resumes_from"])
    st.source += f"; resumes from checkpoint step {steps}"


def jobs_by_rule(jobs: list[dict]) -> dict[str, int]:
    """How many of ``jobs`` (:func:`eagle3_pipeline.snakemake_adapter.needrun_jobs`) each rule has, in the order they first appear."""
    out: dict[str, int] = {}
    for j in jobs:
        out[j["rule"]] = out.get(j["rule"], 0) + 1
    return out


def _bench_seconds(path: Path) -> float | None:
    """Wall seconds of a job from its Snakemake ``benchmark:`` file (first column ``s``)."""
    try:
        lines = path.read_text().splitlines()
        return float(lines[1].split("\t")[0])
    except (OSError, IndexError, ValueError):
        return None


def job_seconds(run_dir: str | Path, bench_dir: str | Path | None, stage: str, wildcards: dict) -> float | None:
    """Wall seconds one job of ``stage`` took: from its Snakemake benchmark file in ``bench_dir``
    (:attr:`RunLayout.bench_dir`: the whole job, start-up and teardown included) when it exists, else
    from its output under ``run_dir`` (model load + work seconds). None when neither has them.

    Raises:
        KeyError: ``wildcards`` lacks a wildcard of the stage's file names (``shard``).
    """
    # a sweep variant's job: the same files in its layout (sweep/<variant>/)
    lay = RunLayout.at(run_dir, bench_dir)
    if bench_dir is not None:
        t = _bench_seconds(Path(stage_benchmark(lay, stage, wildcards)))
        if t is not None:
            return t
    _file, _tok, sec_key, load_key = STAGES[stage]
    r = _read(Path(stage_file(lay, stage, wildcards)))
    keys = (sec_key,) if load_key is None else (load_key, sec_key)
    if isinstance(r, dict) and all(isinstance(r.get(k), int | float) and not isinstance(r.get(k), bool) for k in keys):
        return float(sum(r[k] for k in keys))
    return None


def estimate_vs_actual(plans: list[str | Path], run_dir: str | Path, bench_dir: str | Path | None = None) -> list[dict]:
    """Each stage's estimate against the wall time its jobs took, across a run's resumes.

    Args:
        plans: the start plans of the run (:func:`start_plans`), oldest first. A stage's
            estimate comes from the latest plan in which it was pending: a resumed run's plan
            leaves out the stages finished before the resume, whose estimates stay those of
            the plan they ran under.
        run_dir, bench_dir: ``results/<run>`` and its :attr:`RunLayout.bench_dir` (:func:`job_seconds`).

    Returns:
        Rows ``{stage, estimated_seconds, actual_seconds, actual_over_estimate, source, plan}``
        in stage order; ``actual_seconds`` sums the wall time of the jobs that plan had pending
        (None when none is found), ``plan`` is the plan file's name. Unreadable plans and
        malformed stage entries are skipped; no plan gives no rows.
    """
    latest: dict[str, tuple[dict, str]] = {}
    for path in plans:
        plan = _read(Path(path))
        stages = plan.get("stages") if isinstance(plan, dict) else None
        for st in stages if isinstance(stages, list) else []:
            if (
                isinstance(st, dict)
                and st.get("stage") in STAGES
                and st.get("done") is False
                and isinstance(st.get("seconds"), int | float)
                and isinstance(st.get("pending"), list)
            ):
                latest[st["stage"]] = (st, Path(path).name)
    rows = []
    for stage in STAGES:
        if stage not in latest:
            continue
        st, name = latest[stage]
        try:
            secs = [job_seconds(run_dir, bench_dir, stage, wc) for wc in st["pending"]]
        except (KeyError, TypeError, AttributeError, ValueError):  # a malformed job entry
            continue
        found = [x for x in secs if x is not None]
        act = round(sum(found), 1) if found else None
        rows.append(
            {
                "stage": stage,
                "estimated_seconds": st["seconds"],
                "actual_seconds": act,
                "actual_over_estimate": round(act / st["seconds"], 3) if act and st["seconds"] else None,
                "source": st.get("source"),
                "plan": name,
            }
        )
    return rows

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
Snakemake will run it: :func:`needrun_jobs` reads the DAG a run has built (the ``onstart``
hook), :func:`dry_run_jobs` builds it with a dry-run (``snakemake plan``).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from .sweep import shares_drafter, variant_configs

#: Each stage's output under ``results/<run>/`` that records its work: (file pattern, tokens key,
#: seconds key, model load seconds key). The stage's rule has the same name.
STAGES = {
    "generate_traces": ("traces/shard-{shard}.summary.json", "completion_tokens", "generate_seconds", "model_load_seconds"),
    "extract_hidden_states": ("hidden_states/shard-{shard}.index.json", "num_tokens", "extract_seconds", "model_load_seconds"),
    "train_drafter": ("train/summary.json", "tokens_seen", "seconds", None),  # compilation is inside its seconds
    "evaluate_drafter": ("eval/acceptance.json", "output_tokens", "seconds", "model_load_seconds"),
}

#: Rules that are more jobs of a stage: a sweep variant's training and evaluation
#: (rules/sweep.smk), planned with the run's own per-job figures.
RULE_STAGE = {"train_drafter_variant": "train_drafter", "evaluate_drafter_variant": "evaluate_drafter"}

#: Reference throughputs (tokens/s, load s) per platform and target, with where they were
#: measured (a figure's own ``source`` overrides its reference's). A plan uses the platform's
#: reference nearest the target in parameter count (:func:`reference_for`).
#: ``extract_hidden_states_<backend>`` is the extraction figure for the backend that is not the
#: reference's usual one.
REFERENCES = {
    "cpu": [
        {
            "source": "this project's demo run on 2 CPU cores (SmolLM2-135M)",
            "params": 134_515_008,
            "hidden_size": 576,
            "generate_traces": {"tokens_per_second": 409.0, "load_seconds": 31.0},
            # the hf backend, demo run of 2026-12-01 on an unloaded machine (an earlier, loaded machine gave 1,300)
            "extract_hidden_states": {"tokens_per_second": 920.0, "load_seconds": 3.0},
            # the vllm backend starts a vLLM engine (16-20 s on CPU), the hf backend loads in ~3 s
            "extract_hidden_states_vllm": {
                "tokens_per_second": 2449.0,
                "load_seconds": 18.0,
                "source": "extraction.backend vllm on 2 CPU cores (SmolLM2-135M), the demo's 296 traces, "
                "110,721 tokens: 2,449 tok/s, engine start 16-20 s",
            },
            "train_drafter": {"tokens_per_second": 668.0, "load_seconds": 5.0},
            "evaluate_drafter": {"tokens_per_second": 197.0, "load_seconds": 31.0},
        }
    ],
    # A CPU without fast bf16 (no AVX-512 or AVX2-VNNI-2), where every auto dtype resolves to
    # float32 (precision.py): 4-8x slower than the figures above on the demo.
    "cpu_fp32": [
        {
            "source": "a new user's demo run on 2 AVX2-only EPYC cores (SmolLM2-135M, float32 compute, Muon), "
            "2026-12-02, in part beside other jobs: rough",
            "params": 134_515_008,
            "hidden_size": 576,
            # 60.9K completion tokens in 925 s; 113K tokens extracted in 559 s; 122 training steps of
            # ~1.75K tokens at ~43 s each; 80 evaluation answers (19.9K tokens) in 496 s. Load
            # seconds were not recorded apart: the fast-bf16 machine's.
            "generate_traces": {"tokens_per_second": 68.0, "load_seconds": 31.0},
            "extract_hidden_states": {"tokens_per_second": 203.0, "load_seconds": 3.0},
            "extract_hidden_states_vllm": {
                "tokens_per_second": 541.0,
                "load_seconds": 18.0,
                "source": "extraction.backend vllm: the fast-bf16 CPU's 2,449 tok/s x the hf backend's slowdown "
                "on the AVX2 CPU (203 / 920), not measured",
            },
            "train_drafter": {"tokens_per_second": 41.0, "load_seconds": 5.0},
            "evaluate_drafter": {"tokens_per_second": 43.0, "load_seconds": 31.0},
        }
    ],
    "cuda": [
        {
            "source": "1 x H200, Llama-3.1-8B-shaped target (benchmarks/results/vs_speculators_h200.json)",
            "params": 8_030_261_248,
            "hidden_size": 4096,
            "generate_traces": {"tokens_per_second": 7868.0, "load_seconds": 50.0},
            "extract_hidden_states": {"tokens_per_second": 25764.0, "load_seconds": 41.0},
            "extract_hidden_states_hf": {"tokens_per_second": 10644.0, "load_seconds": 12.0},
            "train_drafter": {"tokens_per_second": 14055.0, "load_seconds": 89.0},
            "evaluate_drafter": {"tokens_per_second": 7868.0, "load_seconds": 50.0},
        },
        {
            "source": "1 x H200, SmolLM2-135M, one engine, config/examples/smollm2-h200.yaml, 2026-12-01 (benchmarks/results/gpu_dag_h200.json)",
            "params": 134_515_008,
            "hidden_size": 576,
            # CUDA graphs on, max_num_seqs 1024, 512-token completions
            "generate_traces": {"tokens_per_second": 22287.0, "load_seconds": 79.0},
            "extract_hidden_states": {"tokens_per_second": 216358.0, "load_seconds": 63.0},
            "extract_hidden_states_hf": {
                "tokens_per_second": 101000.0,
                "load_seconds": 3.0,
                "source": "hf backend, SmolLM2-135M on 1 x H200 (9.5x the 8B shape's 10,644 tok/s, 2026-11-30)",
            },
            # steady rate; the first steps' compilation (104 s) counted as load
            "train_drafter": {"tokens_per_second": 121577.0, "load_seconds": 104.0},
            "evaluate_drafter": {"tokens_per_second": 10703.0, "load_seconds": 98.0},
        },
    ],
}


def reference_for(platform: str, params: int) -> dict:
    """The reference figures of ``platform`` measured on the target nearest ``params`` in size.

    Nearest is the smallest ``|log(reference params / params)|``, so a 1B target is planned
    from SmolLM2-135M's figures on a GPU and a 3B target from the 8B shape's.

    Raises:
        KeyError: an unknown platform.
    """
    import math

    return min(REFERENCES[platform], key=lambda r: abs(math.log(r["params"] / max(params, 1))))


#: Completion tokens per prompt as a fraction of ``max_tokens`` (demo run: 59,792 / 296 / 256).
COMPLETION_FILL = 0.79
#: Prompt tokens per ShareGPT prompt after the target's chat template, by ``prompts.turns``:
#: ``first`` 172 (demo run: 50,929 / 296; the H200 run: 2,603,181 / 15,299 = 170), ``multi``
#: 961 and ``each`` 728: SmolLM2's template over the built-in ShareGPT's 15,075 and 55,180
#: prompts that leave ``generation.min_completion_tokens`` (16) of ``max_seq_len`` 2,048
#: (counted 2026-12-01). A multi-turn prompt carries its history: with ``each``, 68% of the tokens
#: that extraction stores are prompt tokens.
PROMPT_TOKENS_BY_TURNS = {"first": 172, "multi": 961, "each": 728}
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


def _stage_files(run_dir: Path, pattern: str) -> list[Path]:
    return sorted(run_dir.glob(pattern.format(shard="*")))


def measured(run_dir: str | Path) -> dict:
    """Throughput and load seconds measured by this run's finished outputs, per stage.

    Returns ``{stage: {"tokens_per_second", "load_seconds", "source"}}`` for the stages
    that have finished outputs with timings (none for a fresh run).
    """
    d = Path(run_dir)
    out: dict = {}

    def num(r: dict, k: str | None) -> float:
        v = r.get(k) if k else 0.0
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(k)
        return float(v)

    for stage, (pattern, tok_key, sec_key, load_key) in STAGES.items():
        files = _stage_files(d, pattern)
        recs = []
        for r in map(_read, files):  # a file without usable numbers is left out, not an error
            try:
                recs.append((num(r, tok_key), num(r, sec_key), num(r, load_key)))
            except (TypeError, AttributeError):
                continue
        recs = [x for x in recs if x[1] > 0]
        if recs:
            out[stage] = {
                "tokens_per_second": sum(x[0] for x in recs) / sum(x[1] for x in recs),
                "load_seconds": max(x[2] for x in recs),
                "source": f"measured: {len(recs)} file(s) like {files[0]}",
            }
    return out


def make_plan(cfg: dict, target: dict, run_dir: str | Path, platform: str) -> list[StageEstimate]:
    """The plan of a run: one :class:`StageEstimate` per full-model or training stage.

    Args:
        cfg: the validated config.
        target: ``{"params", "num_hidden_layers", "hidden_size"}`` of the target (from its
            config; ``params`` may be estimated by :func:`estimate_params`).
        run_dir: ``results/<run>`` (measured throughputs and this run's token counts are read
            there; which stages are pending, :func:`plan_run` decides from Snakemake's jobs).
        platform: which reference figures apply (:data:`REFERENCES`): ``"cuda"``, ``"cpu"`` (a
            CPU with fast bf16) or ``"cpu_fp32"`` (one without, computing in float32).

    Raises:
        KeyError: an unknown platform.
    """
    from .conventions import resolve_layer_ids

    d = Path(run_dir)
    ref = reference_for(platform, target["params"])
    got = measured(d)
    prompts_summary = _read(d / "prompts/summary.json")
    traces = [
        r
        for r in map(_read, sorted(d.glob("traces/shard-*.summary.json")))
        if isinstance(r, dict) and all(isinstance(r.get(k), int) for k in ("ok", "prompt_tokens", "completion_tokens"))
    ]
    kept = prompts_summary.get("kept") if isinstance(prompts_summary, dict) else None
    prompts_summary = prompts_summary if isinstance(kept, int) else None
    n_prompts = kept if prompts_summary else cfg["prompts"]["max_prompts"]
    src_prompts = "prompts/summary.json" if prompts_summary else "prompts.max_prompts"
    if n_prompts is None and cfg["prompts"]["turns"] == "each":
        n_prompts, src_prompts = 56_000, "every ShareGPT user turn (~56K usable; set prompts.max_prompts for a sharper plan)"
    elif n_prompts is None:
        n_prompts, src_prompts = 17_000, "all ShareGPT first turns (~17K usable; set prompts.max_prompts for a sharper plan)"
    if traces:
        ok = sum(t["ok"] for t in traces)
        p_tok = sum(t["prompt_tokens"] for t in traces) / max(ok, 1)
        c_tok = sum(t["completion_tokens"] for t in traces) / max(ok, 1)
        n_ok, tok_src = ok, "this run's traces"
    else:
        p_tok, c_tok = PROMPT_TOKENS_BY_TURNS[cfg["prompts"]["turns"]], COMPLETION_FILL * cfg["generation"]["max_tokens"]
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
    load_scale = max(1.0, 1 / ratio)  # loading reads the weights: ~ parameters
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
    eval_tokens = int(cfg["evaluation"].get("max_prompts") or 80) * cfg["evaluation"]["max_tokens"]
    # sweep variants: more trainings (those with a drafter of their own) and evaluations, each
    # planned like the run's own
    variants = variant_configs(cfg) if cfg.get("sweep", {}).get("variants") else {}
    n_train = 1 + sum(not shares_drafter(cfg, v) for v in variants.values())
    n_eval = 1 + len(variants)
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
                "tokens_source": "evaluation prompts (80 unless evaluation.max_prompts) x max_tokens",
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
        plan.append(
            StageEstimate(
                stage,
                jobs,
                tokens,
                round(seconds * jobs, 1),
                load,
                round(tps, 1),
                int(disk),
                source,
                work={"tokens_source": tok_src} | work,
            )
        )
    return plan


def estimate_params(text_config) -> int:
    """Parameter count of a dense decoder from its config (embeddings, attention, MLP, norms, head).

    Formula: ``L (2 h^2 + 2 h kv + 3 h i + 2 h) + V h (x2 unless tied) + h`` with ``kv`` =
    key/value heads x head dim (Llama-style gated MLP); an estimate for other shapes.
    """
    h = text_config.hidden_size
    L = text_config.num_hidden_layers
    i = getattr(text_config, "intermediate_size", 4 * h)
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or h // heads
    kv = (getattr(text_config, "num_key_value_heads", None) or heads) * head_dim
    v = text_config.vocab_size
    tied = getattr(text_config, "tie_word_embeddings", False)
    return L * (2 * h * heads * head_dim + 2 * h * kv + 3 * h * i + 2 * h) + v * h * (1 if tied else 2) + h


def format_plan(plan: list[StageEstimate], jobs: list[dict] | None = None) -> str:
    """The plan as a fixed-width text table (hours, minutes, GB), one line per stage, a total,
    and, given ``jobs`` (:func:`needrun_jobs`), a line with every job Snakemake will run by rule.
    A stage's ``jobs`` column reads ``pending/all`` when only some of its jobs are pending."""

    def hm(s: float) -> str:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{s / 60:.1f} min"

    lines = [f"{'stage':24} {'jobs':>5} {'tokens':>12} {'tok/s':>9} {'load s':>7} {'time':>9} {'disk':>9}  source"]
    for p in plan:
        n = f"{len(p.pending)}/{p.jobs}" if p.pending and len(p.pending) < p.jobs else str(p.jobs)
        lines.append(
            f"{p.stage:24} {n:>5} {p.tokens:>12,} {p.tokens_per_second:>9,.0f} {p.load_seconds:>7.0f} {hm(p.seconds):>9} "
            f"{p.disk_bytes / 1e9:>7.2f}GB  {'done; ' if p.done else ''}{p.source}"
        )
    todo = [p for p in plan if not p.done]
    lines.append(
        f"{'total (pending stages)':24} {'':>5} {'':>12} {'':>9} {'':>7} {hm(sum(p.seconds for p in todo)):>9} {sum(p.disk_bytes for p in todo) / 1e9:>7.2f}GB"
    )
    if jobs is not None:
        counts = jobs_by_rule(jobs)
        lines.append(f"Snakemake will run {len(jobs)} job(s): " + (", ".join(f"{r} x{n}" for r, n in counts.items()) or "none"))
    return "\n".join(lines)


def plan_dict(plan: list[StageEstimate], platform: str, jobs: list[dict] | None = None, kind: str = "preview") -> dict:
    """JSON form of a plan: ``kind`` ``"start"`` (kept by a run as it starts, :func:`start_plan_path`)
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


def start_plan_path(run_dir: str | Path, now: datetime | None = None) -> Path:
    """Where a run keeps the plan it starts with: ``<run_dir>/plans/start-<UTC time>.json``
    (``YYYYmmddTHHMMSS.ffffffZ``; names sort in time order, and each run start has its own)."""
    now = now or datetime.now(UTC)
    return Path(run_dir) / "plans" / f"start-{now.astimezone(UTC):%Y%m%dT%H%M%S.%fZ}.json"


def start_plans(run_dir: str | Path) -> list[Path]:
    """The start plans a run directory keeps (:func:`start_plan_path`), oldest first."""
    return sorted((Path(run_dir) / "plans").glob("start-*.json"))


#: The embedded target's shape (SmolLM2-135M-Instruct), for plans made before it is materialized.
BUILTIN_SHAPE = {"params": 134_515_008, "num_hidden_layers": 30, "hidden_size": 576}


def plan_run(
    cfg: dict, target_dir: str | Path | None, run_dir: str | Path, jobs: list[dict], platform: str | None = None
) -> tuple[list[StageEstimate], str]:
    """Plan a workflow run: :func:`make_plan` with the target's shape and the platform found here,
    restricted to the jobs Snakemake will run.

    Args:
        target_dir: the target model directory, or None for the embedded target not yet
            materialized (its known shape is used).
        jobs: the jobs Snakemake will run, as :func:`needrun_jobs` or :func:`dry_run_jobs`
            return them (``{"rule", "wildcards", "output"}``).
        platform: ``"cuda"``, ``"cpu"`` or ``"cpu_fp32"``; None: ``"cuda"`` when this machine sees
            an NVIDIA GPU (:func:`eagle3_pipeline.parallel.visible_gpus`), else ``"cpu"`` where
            the CPU has fast bf16 and ``"cpu_fp32"`` where it has not
            (:func:`eagle3_pipeline.precision.cpu_has_fast_bf16`).

    Returns:
        ``(stages, platform)``; a stage none of whose jobs is in ``jobs`` is marked ``done``,
        and a stage with some of its jobs pending is estimated for those jobs only.
    """
    from .parallel import visible_gpus

    if platform is None:
        from .precision import cpu_has_fast_bf16

        platform = "cuda" if visible_gpus() else "cpu" if cpu_has_fast_bf16() else "cpu_fp32"
    if target_dir is not None and (Path(target_dir) / "config.json").is_file():
        from .target_model import text_config

        tc = text_config(target_dir, cfg["target"]["trust_remote_code"])
        target = {"params": estimate_params(tc), "num_hidden_layers": tc.num_hidden_layers, "hidden_size": tc.hidden_size}
    else:
        target = BUILTIN_SHAPE
    stages = make_plan(cfg, target, run_dir, platform)
    for st in stages:
        st.pending = [j["wildcards"] for j in jobs if RULE_STAGE.get(j["rule"], j["rule"]) == st.stage]
        st.done = not st.pending
        if st.pending and len(st.pending) < st.jobs:  # a resumed stage: only its pending jobs
            frac = len(st.pending) / st.jobs
            st.tokens, st.disk_bytes, st.seconds = int(st.tokens * frac), int(st.disk_bytes * frac), round(st.seconds * frac, 1)
        # a checkpoint applies only to the same shards and vocabulary: none when they are remade
        if st.stage == "train_drafter" and st.pending and not any(j["rule"] in REMAKES_TRAINING_INPUTS for j in jobs):
            _resume_from_checkpoints(st, run_dir)
    return stages, platform


#: Rules whose rerun gives a training new inputs, so that its checkpoint no longer applies.
REMAKES_TRAINING_INPUTS = frozenset(
    {
        "prepare_target_model",
        "prepare_prompts",
        "generate_traces",
        "extract_hidden_states",
        "build_vocab_mapping",
        "build_vocab_mapping_variant",
    }
)


def training_checkpoint_step(run_dir: str | Path, wildcards: dict) -> tuple[int, int] | None:
    """``(step, total_steps)`` of the training checkpoint a pending training job would resume from.

    The run's own training (no wildcards) keeps it in ``train/.checkpoint/progress.json``, a
    sweep variant's (``{"variant": v}``) in ``sweep/<v>/train/.checkpoint/progress.json``
    (:class:`eagle3_pipeline.training.TrainCheckpoint`). None when there is none or it is
    unreadable. Whether the checkpoint still applies (same inputs and settings), only the
    training job decides: :func:`plan_run` ignores checkpoints when a rule of
    :data:`REMAKES_TRAINING_INPUTS` is pending, and a changed training setting (which reruns
    nothing upstream) still makes the plan too short.
    """
    from .resume import checkpoint_progress

    d = Path(run_dir)
    if wildcards.get("variant"):
        d = d / "sweep" / wildcards["variant"]
    return checkpoint_progress(d / "train" / ".checkpoint")


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
    """How many of ``jobs`` (:func:`needrun_jobs`) each rule has, in the order they first appear."""
    out: dict[str, int] = {}
    for j in jobs:
        out[j["rule"]] = out.get(j["rule"], 0) + 1
    return out


def needrun_jobs(workflow) -> list[dict]:
    """The jobs Snakemake will run, from the DAG a Snakemake ``Workflow`` has built.

    Returns ``[{"rule": name, "wildcards": {name: value}, "output": [paths]}]``, in the DAG's
    order (no particular order of execution).

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
            "wildcards": {k: str(v) for k, v in j.wildcards_dict.items()},
            "output": [str(f) for f in j.output],
            "input": [str(f) for f in j.input],
        }
        for j in workflow.dag.needrun_jobs(exclude_finished=False)
    ]
    return [{k: j[k] for k in ("rule", "wildcards", "output")} for j in in_dependency_order(jobs)]


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


def _bench_seconds(path: Path) -> float | None:
    """Wall seconds of a job from its Snakemake ``benchmark:`` file (first column ``s``)."""
    try:
        lines = path.read_text().splitlines()
        return float(lines[1].split("\t")[0])
    except (OSError, IndexError, ValueError):
        return None


def benchmark_dir(run: str) -> str:
    """Where Snakemake writes the per-job benchmark files of run ``run`` (the rules'
    ``benchmark:``): ``logs/<run>/benchmarks``, beside the jobs' logs."""
    return f"logs/{run}/benchmarks"


#: Each stage's Snakemake benchmark file under :func:`benchmark_dir` (the rules' ``benchmark:``;
#: ``{shard}`` is the rule's wildcard; a sweep variant's under ``sweep/<variant>/``).
BENCHMARKS = {
    "generate_traces": "generate_traces/shard-{shard}.tsv",
    "extract_hidden_states": "extract_hidden_states/shard-{shard}.tsv",
    "train_drafter": "train_drafter.tsv",
    "evaluate_drafter": "evaluate_drafter.tsv",
}


def job_seconds(run_dir: str | Path, bench_dir: str | Path | None, stage: str, wildcards: dict) -> float | None:
    """Wall seconds one job of ``stage`` took: from its Snakemake benchmark file in ``bench_dir``
    (:func:`benchmark_dir`: the whole job, start-up and teardown included) when it exists, else
    from its output under ``run_dir`` (model load + work seconds). None when neither has them.

    Raises:
        KeyError: ``wildcards`` lacks a wildcard of the stage's file names (``shard``).
    """
    # a sweep variant's job: the same files under sweep/<variant>/
    sub = f"sweep/{wildcards['variant']}/" if "variant" in wildcards else ""
    if bench_dir is not None:
        t = _bench_seconds(Path(bench_dir) / (sub + BENCHMARKS[stage].format(**wildcards)))
        if t is not None:
            return t
    pattern, _tok, sec_key, load_key = STAGES[stage]
    r = _read(Path(run_dir) / (sub + pattern.format(**wildcards)))
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
        run_dir, bench_dir: ``results/<run>`` and :func:`benchmark_dir` (:func:`job_seconds`).

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

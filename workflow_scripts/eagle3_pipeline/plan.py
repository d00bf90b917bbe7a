"""Run planning: per stage, the work, the estimated time and the disk it will write.

Estimates are ``model load + tokens / throughput`` per stage. The throughput and load time
come, in this order of preference, from

1. this run's own finished outputs (trace summaries, hidden-state indexes, the training
   summary, the acceptance file: each records tokens/s and model load seconds), so a
   resumed or repeated run is planned from what this host measured; or
2. reference figures measured by this project (:data:`REFERENCE`), scaled to the target by
   its parameter count (full-model stages are compute bound: time per token ~ parameters)
   and, for training, by the drafter's hidden size squared.

Every estimate names its source. Token counts use this run's traces when they exist,
otherwise the configured prompt count and ``max_tokens`` with the completion fill measured
on the demo run (:data:`COMPLETION_FILL`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Each stage's output under ``results/<run>/`` that records its work: (file pattern, tokens key,
#: seconds key, model load seconds key). A stage whose files all exist is done.
STAGES = {
    "generate_traces": ("traces/shard-{shard}.summary.json", "completion_tokens", "generate_seconds", "model_load_seconds"),
    "extract_hidden_states": ("hidden_states/shard-{shard}.index.json", "num_tokens", "extract_seconds", "model_load_seconds"),
    "train_drafter": ("train/summary.json", "tokens_seen", "seconds", None),  # compilation is inside its seconds
    "evaluate_drafter": ("eval/acceptance.json", "output_tokens", "seconds", "model_load_seconds"),
}

#: Reference throughputs (tokens/s, load s) per platform and stage, with where they were measured.
REFERENCE = {
    "cpu": {
        "source": "this project's demo run on 2 CPU cores (SmolLM2-135M)",
        "params": 134_515_008,
        "hidden_size": 576,
        "generate_traces": {"tokens_per_second": 409.0, "load_seconds": 31.0},
        "extract_hidden_states": {"tokens_per_second": 1300.0, "load_seconds": 3.0},
        "train_drafter": {"tokens_per_second": 668.0, "load_seconds": 5.0},
        "evaluate_drafter": {"tokens_per_second": 197.0, "load_seconds": 31.0},
    },
    "cuda": {
        "source": "1 x H200, Llama-3.1-8B-shaped target (benchmarks/results/vs_speculators_h200.json)",
        "params": 8_030_261_248,
        "hidden_size": 4096,
        "generate_traces": {"tokens_per_second": 7868.0, "load_seconds": 50.0},
        "extract_hidden_states": {"tokens_per_second": 25764.0, "load_seconds": 41.0},
        "extract_hidden_states_hf": {"tokens_per_second": 10644.0, "load_seconds": 12.0},
        "train_drafter": {"tokens_per_second": 14055.0, "load_seconds": 89.0},
        "evaluate_drafter": {"tokens_per_second": 7868.0, "load_seconds": 50.0},
    },
}
#: Completion tokens per prompt as a fraction of ``max_tokens`` (demo run: 59,792 / 296 / 256).
COMPLETION_FILL = 0.79
#: Prompt tokens per ShareGPT first turn after the chat template (demo run: 50,929 / 296).
PROMPT_TOKENS = 172


@dataclass
class StageEstimate:
    """One stage of the plan. Seconds are wall-clock estimates; bytes are what it writes."""

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
        run_dir: ``results/<run>`` (measured throughputs and existing outputs are read there).
        platform: ``"cpu"`` or ``"cuda"``: which reference figures apply.

    Raises:
        KeyError: an unknown platform.
    """
    from .conventions import resolve_layer_ids

    d = Path(run_dir)
    ref = REFERENCE[platform]
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
    if n_prompts is None:
        n_prompts, src_prompts = 17_000, "all ShareGPT first turns (~17K usable; set prompts.max_prompts for a sharper plan)"
    if traces:
        ok = sum(t["ok"] for t in traces)
        p_tok = sum(t["prompt_tokens"] for t in traces) / max(ok, 1)
        c_tok = sum(t["completion_tokens"] for t in traces) / max(ok, 1)
        n_ok, tok_src = ok, "this run's traces"
    else:
        p_tok, c_tok = PROMPT_TOKENS, COMPLETION_FILL * cfg["generation"]["max_tokens"]
        n_ok, tok_src = n_prompts, f"{PROMPT_TOKENS} prompt tokens + {COMPLETION_FILL:.0%} of max_tokens per prompt (demo run)"
    ratio = ref["params"] / max(target["params"], 1)
    # time per token ~ parameters for a big target; a smaller one gains less on a GPU (measured: the
    # hf backend on an H200 was 9.5x faster for SmolLM2 than for the 8B shape, 60x fewer parameters)
    scale = ratio if platform == "cpu" or ratio < 1 else ratio**0.5
    train_scale = (ref["hidden_size"] / target["hidden_size"]) ** 2
    load_scale = max(1.0, 1 / ratio)  # loading reads the weights: ~ parameters
    replicas = {
        "generate_traces": cfg["vllm"]["data_parallel_size"],
        "extract_hidden_states": cfg["extraction"].get("data_parallel_size") or cfg["vllm"]["data_parallel_size"],
    }
    shards = cfg["prompts"]["num_shards"]

    def rate(stage: str, ref_key: str | None = None, s: float = scale) -> tuple[float, float, str]:
        if stage in got:
            m = got[stage]
            return m["tokens_per_second"], m["load_seconds"], m["source"]
        r = ref[ref_key or stage]
        d_ = replicas.get(stage, 1)
        note = f" x {d_} replicas" if d_ > 1 else ""
        return (
            r["tokens_per_second"] * s * d_,
            r["load_seconds"] * (load_scale if stage != "train_drafter" else 1.0),
            f"reference ({ref['source']}) x {s:.3g}{note}; rough: tensor/pipeline parallel not modelled",
        )

    _aux, layers = resolve_layer_ids(cfg["extraction"]["aux_layer_ids"], target["num_hidden_layers"])
    dtype = cfg["extraction"]["storage_dtype"]
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}[dtype]
    per_token = len(layers) * target["hidden_size"] * itemsize + (4 * len(layers) if dtype == "float8_e4m3fn" else 0)
    gen_tokens = int(n_prompts * c_tok)
    ext_tokens = int(n_ok * (p_tok + c_tok))
    epochs = cfg["training"]["epochs"]
    train_fraction = 1.0 - cfg["training"]["val_fraction"]
    eval_tokens = int(cfg["evaluation"].get("max_prompts") or 80) * cfg["evaluation"]["max_tokens"]
    plan = []
    for stage, jobs, tokens, ref_key, s, disk, work in (
        ("generate_traces", shards, gen_tokens, None, scale, 0, {"prompts": n_prompts, "prompts_source": src_prompts}),
        (
            "extract_hidden_states",
            shards,
            ext_tokens,
            None if cfg["extraction"]["backend"] == "vllm" or platform == "cpu" else "extract_hidden_states_hf",
            scale,
            ext_tokens * per_token,
            {"samples": n_ok, "layers": layers, "bytes_per_token": per_token, "storage_dtype": dtype},
        ),
        ("train_drafter", 1, int(ext_tokens * epochs * train_fraction), None, train_scale, 0, {"epochs": epochs}),
        (
            "evaluate_drafter",
            1,
            eval_tokens,
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
        per_job = tokens / max(jobs, 1)
        seconds = load + per_job / tps  # jobs of one stage run one after another on one host
        plan.append(
            StageEstimate(
                stage,
                jobs,
                tokens,
                round(seconds * jobs if stage != "train_drafter" else seconds, 1),
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


def format_plan(plan: list[StageEstimate]) -> str:
    """The plan as a fixed-width text table (hours, minutes, GB), one line per stage, and a total."""

    def hm(s: float) -> str:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{s / 60:.1f} min"

    lines = [f"{'stage':24} {'jobs':>4} {'tokens':>12} {'tok/s':>9} {'load s':>7} {'time':>9} {'disk':>9}  source"]
    for p in plan:
        lines.append(
            f"{p.stage:24} {p.jobs:>4} {p.tokens:>12,} {p.tokens_per_second:>9,.0f} {p.load_seconds:>7.0f} {hm(p.seconds):>9} "
            f"{p.disk_bytes / 1e9:>7.2f}GB  {'done; ' if p.done else ''}{p.source}"
        )
    todo = [p for p in plan if not p.done]
    lines.append(
        f"{'total (pending stages)':24} {'':>4} {'':>12} {'':>9} {'':>7} {hm(sum(p.seconds for p in todo)):>9} {sum(p.disk_bytes for p in todo) / 1e9:>7.2f}GB"
    )
    return "\n".join(lines)


def plan_dict(plan: list[StageEstimate], platform: str) -> dict:
    """JSON form of a plan (``plan.json``)."""
    return {"platform": platform, "stages": [asdict(p) for p in plan], "total_seconds": sum(p.seconds for p in plan if not p.done)}


#: The embedded target's shape (SmolLM2-135M-Instruct), for plans made before it is materialized.
BUILTIN_SHAPE = {"params": 134_515_008, "num_hidden_layers": 30, "hidden_size": 576}


def plan_run(cfg: dict, target_dir: str | Path | None, run_dir: str | Path, platform: str | None = None) -> tuple[list[StageEstimate], str]:
    """Plan a workflow run: :func:`make_plan` with the target's shape and the platform found here.

    Args:
        target_dir: the target model directory, or None for the embedded target not yet
            materialized (its known shape is used).
        platform: ``"cpu"``/``"cuda"``; None: ``"cuda"`` when this machine sees an NVIDIA GPU
            (:func:`eagle3_pipeline.parallel.visible_gpus`), else ``"cpu"``.

    Returns:
        ``(stages, platform)``; a stage whose outputs all exist is marked ``done``.
    """
    from .parallel import visible_gpus

    if platform is None:
        platform = "cuda" if visible_gpus() else "cpu"
    if target_dir is not None and (Path(target_dir) / "config.json").is_file():
        from .target_model import text_config

        tc = text_config(target_dir, cfg["target"]["trust_remote_code"])
        target = {"params": estimate_params(tc), "num_hidden_layers": tc.num_hidden_layers, "hidden_size": tc.hidden_size}
    else:
        target = BUILTIN_SHAPE
    stages = make_plan(cfg, target, run_dir, platform)
    shards = [f"{i:05d}" for i in range(cfg["prompts"]["num_shards"])]
    for st in stages:
        pattern = STAGES[st.stage][0]
        st.done = all((Path(run_dir) / pattern.format(shard=s)).exists() for s in shards)
    return stages, platform


def _bench_seconds(path: Path) -> float | None:
    """Wall seconds of a job from its Snakemake ``benchmark:`` file (first column ``s``)."""
    try:
        lines = path.read_text().splitlines()
        return float(lines[1].split("\t")[0])
    except (OSError, IndexError, ValueError):
        return None


def actual_seconds(run_dir: str | Path, bench_dir: str | Path | None = None) -> dict[str, float]:
    """Wall seconds each stage took, summed over its jobs.

    From the jobs' Snakemake benchmark files in ``bench_dir`` (``benchmarks/<run>``: the whole
    job, start-up and teardown included) when they exist, else from the stage outputs
    (model load + work seconds). Stages with neither are left out.
    """
    d = Path(run_dir)
    out: dict[str, float] = {}
    if bench_dir is not None:
        b = Path(bench_dir)
        for stage, files in (
            ("generate_traces", sorted(b.glob("generate_traces/shard-*.tsv"))),
            ("extract_hidden_states", sorted(b.glob("extract_hidden_states/shard-*.tsv"))),
            ("train_drafter", [b / "train_drafter.tsv"]),
            ("evaluate_drafter", [b / "evaluate_drafter.tsv"]),
        ):
            secs = [x for x in map(_bench_seconds, files) if x is not None]
            if secs:
                out[stage] = round(sum(secs), 1)

    def total(files: list[Path], keys: tuple[str, ...]) -> float | None:
        recs = [r for r in map(_read, files) if isinstance(r, dict) and all(isinstance(r.get(k), int | float) for k in keys)]
        return sum(sum(r[k] for k in keys) for r in recs) if recs else None

    for stage, (pattern, _tok, sec_key, load_key) in STAGES.items():
        keys = (sec_key,) if load_key is None else (load_key, sec_key)
        t = None if stage in out else total(_stage_files(d, pattern), keys)
        if t is not None:
            out[stage] = round(t, 1)
    return out


def estimate_vs_actual(plan_json: str | Path, run_dir: str | Path, bench_dir: str | Path | None = None) -> list[dict]:
    """Rows ``{stage, estimated_seconds, actual_seconds, actual_over_estimate, source}`` for the
    stages the plan (``plan.json`` written at the start of the run) had pending; actual seconds
    are wall time (:func:`actual_seconds`). Empty when there is no readable plan; malformed
    stage entries are skipped."""
    plan = _read(Path(plan_json))
    stages = plan.get("stages") if isinstance(plan, dict) else None
    if not isinstance(stages, list):
        return []
    got = actual_seconds(run_dir, bench_dir)
    rows = []
    for st in stages:
        if not isinstance(st, dict) or st.get("done") is not False or not isinstance(st.get("seconds"), int | float):
            continue
        act = got.get(st.get("stage"))
        rows.append(
            {
                "stage": st["stage"],
                "estimated_seconds": st["seconds"],
                "actual_seconds": act,
                "actual_over_estimate": round(act / st["seconds"], 3) if act and st["seconds"] else None,
                "source": st.get("source"),
            }
        )
    return rows

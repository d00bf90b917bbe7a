"""The run layout (eagle3_pipeline.layout): its paths are the spellings a finished run has on disk."""

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.layout import BUILTIN_TARGET_DIR, RunLayout, index_beside, pids_of, rejects_beside, shard_ids, summary_beside

# The files of a finished reduced run with sweep variants (.test/config.yaml, run "e2e"; variants
# ttt1 with a training of its own and vocab8k with a vocab of its own), as the workflow wrote
# them before the layout existed (every output its jobs declared).
FINISHED_RUN = [
    line
    for line in """
results/e2e/drafter
results/e2e/eval/acceptance.json
results/e2e/eval/outputs.jsonl
results/e2e/eval/prompts.jsonl
results/e2e/eval/rejects.jsonl
results/e2e/hidden_states/shard-00000.index.json
results/e2e/hidden_states/shard-00000.safetensors
results/e2e/hidden_states/shard-00001.index.json
results/e2e/hidden_states/shard-00001.safetensors
results/e2e/manifest.json
results/e2e/plots/acceptance.png
results/e2e/prompts/rejects.jsonl
results/e2e/prompts/shard-00000.jsonl
results/e2e/prompts/shard-00001.jsonl
results/e2e/prompts/summary.json
results/e2e/summary.json
results/e2e/sweep.json
results/e2e/sweep.md
results/e2e/sweep/ttt1/drafter
results/e2e/sweep/ttt1/eval/acceptance.json
results/e2e/sweep/ttt1/eval/outputs.jsonl
results/e2e/sweep/ttt1/eval/rejects.jsonl
results/e2e/sweep/ttt1/train/metrics.jsonl
results/e2e/sweep/ttt1/train/summary.json
results/e2e/sweep/vocab8k/vocab/coverage.json
results/e2e/sweep/vocab8k/vocab/d2t.npy
results/e2e/sweep/vocab8k/vocab/t2d.npy
results/e2e/sweep/vocab8k/vocab/token_freq.npy
results/e2e/traces/shard-00000.jsonl
results/e2e/traces/shard-00000.rejects.jsonl
results/e2e/traces/shard-00000.summary.json
results/e2e/train/metrics.jsonl
results/e2e/train/summary.json
results/e2e/vocab/coverage.json
results/e2e/vocab/d2t.npy
results/e2e/vocab/t2d.npy
results/e2e/vocab/token_freq.npy
logs/e2e/build_vocab_mapping.log
logs/e2e/generate_traces/shard-00000.log
logs/e2e/sweep/ttt1/train_drafter.log
logs/e2e/benchmarks/generate_traces/shard-00001.tsv
logs/e2e/benchmarks/train_drafter.tsv
logs/e2e/benchmarks/sweep/ttt1/evaluate_drafter.tsv
logs/prepare_target_model.log
logs/prepare_target_model.benchmark.tsv
""".splitlines()
    if line
]


def _layout_paths(lay: RunLayout) -> list[str]:
    t1, v8 = lay.variant("ttt1"), lay.variant("vocab8k")
    return [
        lay.drafter(),
        lay.acceptance(),
        lay.eval_outputs(),
        lay.eval_prompts(),
        lay.eval_rejects(),
        lay.hidden_index("00000"),
        lay.hidden_states("00000"),
        lay.hidden_index("00001"),
        lay.hidden_states("00001"),
        lay.manifest(),
        lay.plot("acceptance"),
        lay.prompt_rejects(),
        lay.prompt_shard("00000"),
        lay.prompt_shard("00001"),
        lay.prompt_summary(),
        lay.summary(),
        lay.sweep_json(),
        lay.sweep_table(),
        t1.drafter(),
        t1.acceptance(),
        t1.eval_outputs(),
        t1.eval_rejects(),
        t1.train_metrics(),
        t1.train_summary(),
        v8.coverage(),
        v8.vocab("d2t"),
        v8.vocab("t2d"),
        v8.vocab("token_freq"),
        lay.traces("00000"),
        lay.trace_rejects("00000"),
        lay.trace_summary("00000"),
        lay.train_metrics(),
        lay.train_summary(),
        lay.coverage(),
        lay.vocab("d2t"),
        lay.vocab("t2d"),
        lay.vocab("token_freq"),
        lay.log("build_vocab_mapping"),
        lay.log("generate_traces", "00000"),
        t1.log("train_drafter"),
        lay.benchmark("generate_traces", "00001"),
        lay.benchmark("train_drafter"),
        t1.benchmark("evaluate_drafter"),
        RunLayout.target_model_log(),
        RunLayout.target_model_benchmark(),
    ]


def test_layout_paths_are_the_spellings_of_a_finished_run():
    assert _layout_paths(RunLayout("e2e")) == FINISHED_RUN


def test_wildcards_pass_through_as_patterns_snakemake_matches():
    lay = RunLayout("default")
    assert lay.traces("{shard}") == "results/default/traces/shard-{shard}.jsonl"
    assert lay.hidden_index("{shard}") == "results/default/hidden_states/shard-{shard}.index.json"
    assert lay.log("extract_hidden_states", "{shard}") == "logs/default/extract_hidden_states/shard-{shard}.log"
    v = lay.variant("{variant}")
    assert v.vocab("d2t") == "results/default/sweep/{variant}/vocab/d2t.npy"
    assert v.log("evaluate_drafter") == "logs/default/sweep/{variant}/evaluate_drafter.log"
    assert v.benchmark("train_drafter") == "logs/default/benchmarks/sweep/{variant}/train_drafter.tsv"


def test_shard_ids_name_every_shard_in_order_as_the_finished_run_does():
    assert shard_ids(3) == ["00000", "00001", "00002"] and shard_ids(0) == []
    ids = shard_ids(1000)
    assert ids[-1] == "00999" and ids == sorted(ids) and len(set(ids)) == 1000
    assert RunLayout("e2e").traces(shard_ids(1)[0]) == "results/e2e/traces/shard-00000.jsonl"  # a finished run's name


def test_run_state_paths():
    lay = RunLayout("r")
    assert lay.pids() == "results/r/.pids"
    assert lay.variant("v").pids() == "results/r/.pids"  # a variant's engines are recorded with the run's
    # a shard job's library code finds the same folder from its output
    assert pids_of(lay.traces("00001")).as_posix() == pids_of(lay.hidden_states("00000")).as_posix() == lay.pids()
    assert lay.train_checkpoint() == "results/r/train/.checkpoint"
    assert lay.variant("v").train_checkpoint() == "results/r/sweep/v/train/.checkpoint"
    assert lay.plan_preview() == "results/r/plan.json"
    t = datetime(2026, 12, 1, 10, 2, 3, 45, tzinfo=UTC)
    assert lay.start_plan(t) == "results/r/plans/start-20261201T100203.000045Z.json"


def test_layout_of_an_existing_run_directory(tmp_path):
    run = tmp_path / "results" / "x"
    lay = RunLayout.at(run, bench_dir=tmp_path / "bench")
    assert lay.run == "x" and lay.dir == run.as_posix()
    assert lay.train_summary() == f"{run.as_posix()}/train/summary.json"
    assert lay.benchmark("generate_traces", "00002") == f"{(tmp_path / 'bench').as_posix()}/generate_traces/shard-00002.tsv"
    assert lay.variant("v").benchmark("train_drafter") == f"{(tmp_path / 'bench').as_posix()}/sweep/v/train_drafter.tsv"
    assert RunLayout.at("results/x") == RunLayout("x")
    assert lay.relative(f"{run.as_posix()}/vocab/d2t.npy") == "vocab/d2t.npy"
    assert lay.relative("resources/models/m") == "resources/models/m"
    (run / "plans").mkdir(parents=True)
    for name in ("start-20261201T100203.000002Z.json", "start-20261201T090000.000000Z.json", "plan.json"):
        (run / "plans" / name).write_text("{}")
    assert [p.name for p in lay.start_plans()] == ["start-20261201T090000.000000Z.json", "start-20261201T100203.000002Z.json"]


def test_files_beside_a_shard():
    assert index_beside("a/shard-00003.safetensors").as_posix() == "a/shard-00003.index.json"
    assert summary_beside("a/shard-00003.jsonl").as_posix() == "a/shard-00003.summary.json"
    assert rejects_beside("a/shard-00003.jsonl").as_posix() == "a/shard-00003.rejects.jsonl"


def _every_layout_path(lay: RunLayout, shards: list[str], variants: list[str], rules: list[str]) -> set[str]:
    """Every path ``lay`` (its benchmarks folder too) and its variants' layouts (the ``{variant}`` wildcard's too) give for the
    shards (and the ``{shard}`` wildcard) and rule names: each public method called with each
    fitting argument."""
    import inspect

    out = {lay.dir, lay.bench_dir, BUILTIN_TARGET_DIR, RunLayout.target_model_log(), RunLayout.target_model_benchmark()}
    for one in (lay, *(lay.variant(v) for v in [*variants, "{variant}"])):
        for name, fn in inspect.getmembers(one, inspect.ismethod):
            params = list(inspect.signature(fn).parameters)
            if name.startswith("_") or name in ("at", "variant", "relative", "start_plans"):
                continue
            if params == ["shard"]:
                out |= {fn(s) for s in [*shards, "{shard}"]}
            elif name in ("log", "benchmark"):
                out |= {fn(r, s) for r in rules for s in [None, "{shard}"]}
            elif name == "vocab":
                out |= {fn(k) for k in ("d2t", "t2d", "token_freq")}
            elif name == "plot":
                out.add(fn("*"))
            elif not params or params == ["now"]:
                out.add(fn())
    return out


@pytest.mark.workflow
def test_every_path_the_rules_declare_comes_from_the_layout(tmp_path):
    import fnmatch
    import re

    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    from eagle3_pipeline.plan import STAGES
    from eagle3_pipeline.snakemake_adapter import rule_stage

    root = Path(__file__).resolve().parents[1]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "sweep": {
                    "variants": {
                        "ttt1": {"training": {"ttt_steps": 1, "init_from": str(tmp_path / "old-drafter")}},
                        "v8": {"vocab": {"draft_vocab_size": 8192}},
                    }
                }
            }
        )
    )
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[root / "config/config.yaml", root / ".test/config.yaml", sweep]),
            snakefile=root / "Snakefile",
            workdir=tmp_path / "wd",
        )._workflow
        lay = wf.globals["layout"]
        assert lay == RunLayout("e2e")
        rules = {r.name.removesuffix("_variant") for r in wf.rules}
        known = _every_layout_path(lay, wf.globals["SHARDS"], list(wf.globals["VARIANTS"]), sorted(rules))
        declared = {}
        for r in wf.rules:
            files = [*r.output, *r.log, *([r.benchmark] if r.benchmark else [])]
            files += [f for f in r.input if isinstance(f, str) and not f.startswith("<function")]
            files += [p for p in r.params if isinstance(p, str) and "/" in p]
            for f in files:
                # Snakemake adds wildcard constraints to declared patterns: {shard,\d{5}} -> {shard}
                declared[re.sub(r"\{(\w+),[^{}]*(\{[^{}]*\}[^{}]*)*\}", r"{\1}", str(f))] = r.name
        declared.pop(str(root / "Snakefile"), None)  # rule plan's snakefile param
        outside = {p: rule for p, rule in declared.items() if p not in known and not any(fnmatch.fnmatch(p, k) for k in known if "*" in k)}
        assert outside == {}
        assert lay.log("train_drafter") in declared and lay.variant("{variant}").benchmark("evaluate_drafter") in declared
        assert declared[lay.variant("{variant}").vocab("d2t")] == "build_vocab_mapping_variant"
        # a rule's stage is the script it runs (plan): a variant's rule is a job of its stage
        stages = {r.name: rule_stage(r) for r in wf.rules}
        assert all(stages[s] == s for s in STAGES) and stages["all"] == "all"
        assert {n: stages[n] for n in stages if n.endswith("_variant")} == {
            "build_vocab_mapping_variant": "build_vocab_mapping",
            "train_drafter_variant": "train_drafter",
            "evaluate_drafter_variant": "evaluate_drafter",
        }
        # a variant's rule has every param of the run's rule; those its sweep.smk does not set are the run's own
        by_name = {r.name: r for r in wf.rules}
        for name in ("build_vocab_mapping_variant", "train_drafter_variant", "evaluate_drafter_variant"):
            mine, base = dict(by_name[name].params.items()), dict(by_name[name.removesuffix("_variant")].params.items())
            assert list(mine) == list(base), name
            assert [k for k in base if mine[k] is not base[k] and mine[k] != base[k]] == {
                "build_vocab_mapping_variant": ["draft_vocab_size", "init_from", "init_identity"],
                "train_drafter_variant": ["training", "init_identity"],
                "evaluate_drafter_variant": ["evaluation", "num_speculative_tokens", "vllm"],
            }[name]
        # the manifest's jobs: those the final outputs need, a variant's only where it has its own files
        jobs = wf.globals["get_lineage_jobs"]()
        assert [(j["rule"], j["wildcards"]) for j in jobs if "variant" in j["wildcards"]] == [
            ("build_vocab_mapping_variant", {"variant": "ttt1"}),  # a warm start's vocab is its drafter's
            ("build_vocab_mapping_variant", {"variant": "v8"}),
            ("train_drafter_variant", {"variant": "ttt1"}),
            ("train_drafter_variant", {"variant": "v8"}),
            ("evaluate_drafter_variant", {"variant": "ttt1"}),
            ("evaluate_drafter_variant", {"variant": "v8"}),
        ]
        # a variant's warm-start drafter is a source of its own vocab and training jobs, no other's
        old = {"type": "drafter", "path": str(tmp_path / "old-drafter")}
        assert {(j["rule"], j["wildcards"].get("variant")) for j in jobs if old in j["sources"]} == {
            ("build_vocab_mapping_variant", "ttt1"),
            ("train_drafter_variant", "ttt1"),
        }
        assert [j["rule"] for j in jobs if not j["wildcards"]] == [
            "prepare_target_model", "prepare_prompts", "prepare_eval_prompts", "build_vocab_mapping", "train_drafter",
            "evaluate_drafter", "summarize_run", "plot_run", "sweep_table",
        ]  # fmt: skip
        # the input functions too: every file the DAG's jobs read or write under results/ is a layout path
        from eagle3_pipeline.lineage import lineage_outputs

        finals = lineage_outputs(jobs)
        assert len(finals) > 40 and not [p for p in finals if p not in known and not fnmatch.fnmatch(p, lay.plot("*"))]

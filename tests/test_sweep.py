"""Drafter sweeps inside a run (sweep.variants): configs, sharing, the table, the DAG and a real sweep."""

import json
import re
import shutil

import pytest
import yaml
from e2e_support import SMALL, make_workdir, snakemake_cli

from eagle3_pipeline.config import ConfigError, validate_config
from eagle3_pipeline.sweep import changes, format_table, shares_drafter, shares_vocab, sweep_row, variant_configs


def _cfg(variants):
    return validate_config({"training": {"epochs": 3}, "sweep": {"variants": variants}})


def test_variant_configs_merge_the_variant_into_the_run_settings():
    cfg = _cfg({"ttt5": {"training": {"ttt_steps": 5}}, "v4k": {"vocab": {"draft_vocab_size": 4096}}})
    got = variant_configs(cfg)
    assert list(got) == ["ttt5", "v4k"]
    assert got["ttt5"]["training"]["ttt_steps"] == 5 and got["ttt5"]["training"]["epochs"] == 3  # the run's other settings kept
    assert got["ttt5"]["sweep"] == {"variants": {}} and got["ttt5"]["vocab"] == cfg["vocab"]
    assert got["v4k"]["vocab"]["draft_vocab_size"] == 4096 and got["v4k"]["training"] == cfg["training"]
    assert changes(cfg, got["ttt5"]) == {"training.ttt_steps": 5}
    assert shares_vocab(cfg, got["ttt5"]) and not shares_drafter(cfg, got["ttt5"])
    assert not shares_vocab(cfg, got["v4k"]) and not shares_drafter(cfg, got["v4k"])
    k2 = variant_configs(_cfg({"k2": {"evaluation": {"num_speculative_tokens": 2}}}))["k2"]
    assert shares_drafter(cfg, k2)  # only evaluation differs: the run's drafter is evaluated again


@pytest.mark.parametrize(
    "variant, message",
    [
        ({"training": {"ttt_stepz": 5}}, "sweep.variants.bad: invalid configuration"),
        ({"training": {"ttt_steps": 0}}, "training.ttt_steps: 0 is less than the minimum of 1"),
        ({"evaluation": {"prompts": {"type": "builtin_mtbench"}}}, "sweep.variants.bad.evaluation.prompts: every variant"),
        ({"evaluation": {"max_prompts": 5}}, "sweep.variants.bad.evaluation.max_prompts"),
        ({"training": {"epochs": 3}}, "sweep.variants.bad: changes nothing"),
        ({"training": {"loader_workers": 2}}, "sweep.variants.bad: changes nothing"),
        # the same measurements in another order (the run's default is [1, 16, 64])
        ({"evaluation": {"speedup": {"concurrency": [64, 1, 16]}}}, "sweep.variants.bad: changes nothing"),
    ],
)
def test_a_bad_variant_is_an_error_naming_it(variant, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        variant_configs(_cfg({"bad": variant}))


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "-x", 1, True])
def test_a_variant_name_must_be_a_folder_name(name):
    # ".." would write the run's own drafter (results/<run>/sweep/../drafter); YAML reads 1: and yes: as non-strings
    with pytest.raises(ConfigError, match=r"sweep\.variants"):
        variant_configs(_cfg({name: {"training": {"ttt_steps": 2}}}))


def test_the_schema_refuses_variants_outside_vocab_training_evaluation():
    with pytest.raises(ConfigError, match="sweep.variants.x: Additional properties are not allowed .'generation'"):
        _cfg({"x": {"generation": {"max_tokens": 5}}})
    with pytest.raises(ConfigError, match="sweep.variants"):
        _cfg({"a/b": {"training": {"ttt_steps": 2}}})  # a name that is not a path segment


ACC = {"acceptance_length": 2.5, "per_position_acceptance_rate": [0.75, 0.5, 0.25], "num_speculative_tokens": 3}
TRAIN = {
    "ttt_steps": 3,
    "epochs": 4,
    "train_samples": 14580,
    "tokens_seen": 31235296,
    "seconds": 334.9,
    "final_val": {"full_acc_0": 0.877, "full_acc_1": 0.79, "full_acc_2": 0.729},
}
COV = {"draft_vocab_size": 32000, "coverage": 1.0}


def test_sweep_rows_and_table():
    run = sweep_row("(run)", {}, ACC, TRAIN, COV, shared=False)
    assert run["tau"] == 2.5 and run["train_seconds"] == 334.9 and run["val_full_acc"] == [0.877, 0.79, 0.729]
    k2 = sweep_row(
        "k2",
        {"evaluation.num_speculative_tokens": 2},
        {"acceptance_length": 2.7, "per_position_acceptance_rate": [0.8, 0.9], "num_speculative_tokens": 2},
        TRAIN,
        COV,
        shared=True,
    )
    assert k2["train_seconds"] is None and k2["val_full_acc"] == [0.877, 0.79]  # its drafter's cost is the run's
    lines = format_table([run, k2]).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert (
        lines[2]
        == "| k2 | evaluation.num_speculative_tokens=2 | 2.700 | 0.80 / 0.90 | 2 | 32000 (1.0000) | 3 | 4 | 14,580 | 31,235,296 | - | 0.88 / 0.79 |"
    )
    assert lines[3].startswith("| (run) | (the run's own) | 2.500 | 0.75 / 0.50 / 0.25 | 3 |") and "| 335 |" in lines[3]


def test_each_variant_uses_the_run_vocab_and_drafter_unless_its_settings_differ():
    from eagle3_pipeline.layout import RunLayout
    from eagle3_pipeline.sweep import drafter_layout, sweep_rows, vocab_layout

    run = validate_config({})
    variants = variant_configs(validate_config({"sweep": {"variants": SWEEP}}))
    lay = RunLayout("r")
    assert [vocab_layout(run, variants[v], lay, v) for v in SWEEP] == [lay, lay, lay.variant("v1k")]
    assert [drafter_layout(run, variants[v], lay, v) for v in SWEEP] == [lay, lay.variant("ttt1"), lay.variant("v1k")]
    rows = sweep_rows(run, variants, lay)
    assert [(r["name"], r["shared"]) for r in rows] == [("(run)", False), ("k1", True), ("ttt1", False), ("v1k", False)]
    assert rows[0] == {
        "name": "(run)",
        "changes": {},
        "shared": False,
        "acceptance": "results/r/eval/acceptance.json",
        "train_summary": "results/r/train/summary.json",
        "coverage": "results/r/vocab/coverage.json",
    }
    assert rows[1]["changes"] == {"evaluation.num_speculative_tokens": 1}
    assert [r["acceptance"] for r in rows[1:]] == [f"results/r/sweep/{v}/eval/acceptance.json" for v in SWEEP]  # each its own
    assert [r["train_summary"] for r in rows[1:]] == [
        "results/r/train/summary.json",
        "results/r/sweep/ttt1/train/summary.json",
        "results/r/sweep/v1k/train/summary.json",
    ]
    assert [r["coverage"] for r in rows[1:]] == ["results/r/vocab/coverage.json"] * 2 + ["results/r/sweep/v1k/vocab/coverage.json"]


SWEEP = {
    "k1": {"evaluation": {"num_speculative_tokens": 1}},  # the run's drafter, evaluated with k = 1
    # a drafter of its own, on the run's vocab, trained with the default optimizer (the reduced config's is AdamW)
    "ttt1": {"training": {"ttt_steps": 1, "epochs": 1, "optimizer": "muon"}},
    "v1k": {"vocab": {"draft_vocab_size": 1024}},  # its own vocab and drafter
}


@pytest.mark.workflow
def test_the_dag_reuses_the_run_vocab_and_drafter_where_a_variant_leaves_them(tmp_path):
    cfg = make_workdir(tmp_path, SMALL | {"sweep": {"variants": SWEEP}})
    r = snakemake_cli(tmp_path, cfg, "-n", "--cores", "2")
    assert r.returncode == 0, r.stderr + r.stdout
    blocks = re.split(r"^\[.*\d{4}\]$", r.stdout, flags=re.M)

    def job(rule, variant):
        (b,) = [b for b in blocks if f"rule {rule}:" in b and f"sweep/{variant}/" in b]
        return dict(re.findall(r"^\s+(input|output): (.*)$", b, flags=re.M))

    assert not [b for b in blocks if "rule train_drafter_variant:" in b and "sweep/k1/" in b]
    assert job("evaluate_drafter_variant", "k1")["input"].startswith("results/e2e/drafter, results/e2e/train/summary.json")
    assert job("train_drafter_variant", "ttt1")["input"].startswith("results/e2e/vocab/d2t.npy, results/e2e/vocab/t2d.npy")
    assert job("train_drafter_variant", "v1k")["input"].startswith("results/e2e/sweep/v1k/vocab/d2t.npy")
    assert [b for b in blocks if "rule build_vocab_mapping_variant:" in b and "sweep/v1k/" in b]
    assert len([b for b in blocks if "rule build_vocab_mapping_variant:" in b]) == 1
    assert "results/e2e/sweep.md" in [b for b in blocks if "rule sweep_table:" in b][0]
    # trainings and evaluations interleave in a sweep: every training takes the full-model lock too
    trains = [b for b in blocks if re.search(r"rule train_drafter(_variant)?:", b)]
    assert len(trains) == 3 and all("gpu=1" in b and "full_model=1" in b for b in trains)


@pytest.mark.e2e
def test_a_sweep_on_a_finished_run_trains_and_evaluates_only_the_variants(e2e_run, tmp_path):
    src, _, _ = e2e_run
    wd = tmp_path / "wd"
    shutil.copytree(src, wd, symlinks=True)  # the finished run, its metadata and mtimes
    res = wd / "results" / "e2e"
    traces_before = {p: p.stat().st_mtime_ns for p in res.glob("traces/*.jsonl")}
    cfg = wd / "sweep.yaml"
    own = yaml.safe_load((wd / "small.yaml").read_text())  # the finished run's config, as it ran
    cfg.write_text(yaml.safe_dump(own | {"sweep": {"variants": {k: SWEEP[k] for k in ("k1", "ttt1")}}}))
    r = snakemake_cli(wd, cfg, "--cores", "4", "--resources", "mem_gb=100")
    assert r.returncode == 0, r.stderr[-4000:]
    ran = set(re.findall(r"^(?:local)?rule (\w+):", r.stderr, flags=re.M))
    assert ran == {"evaluate_drafter_variant", "train_drafter_variant", "sweep_table", "write_manifest", "all"}, ran
    # job priorities: k1's evaluation (its drafter exists) goes before ttt1's training, and ttt1's
    # evaluation follows its training before anything else starts
    started = re.findall(r"^(?:local)?rule (\w+_variant):\n(?:\s+.*\n)*?\s+wildcards: variant=(\w+)", r.stderr, flags=re.M)
    assert started == [("evaluate_drafter_variant", "k1"), ("train_drafter_variant", "ttt1"), ("evaluate_drafter_variant", "ttt1")], started
    assert {p: p.stat().st_mtime_ns for p in res.glob("traces/*.jsonl")} == traces_before

    rows = {r["variant"]: r for r in json.loads((res / "sweep.json").read_text())["rows"]}
    run_acc = json.loads((res / "eval/acceptance.json").read_text())
    assert rows["(run)"]["tau"] == run_acc["acceptance_length"]
    k1 = json.loads((res / "sweep/k1/eval/acceptance.json").read_text())
    assert k1["num_speculative_tokens"] == 1 and len(k1["per_position_acceptance_rate"]) == 1
    assert k1["drafter"] == str((res / "drafter").resolve())  # the run's own drafter
    assert rows["k1"]["tau"] == k1["acceptance_length"] and rows["k1"]["train_seconds"] is None
    ttt1 = json.loads((res / "sweep/ttt1/train/summary.json").read_text())
    assert ttt1["ttt_steps"] == 1 and ttt1["epochs"] == 1
    assert rows["ttt1"]["changes"] == {"training.epochs": 1, "training.optimizer": "muon", "training.ttt_steps": 1}
    assert rows["ttt1"]["train_seconds"] == ttt1["seconds"] and rows["ttt1"]["num_speculative_tokens"] == 1
    assert (
        json.loads((res / "sweep/ttt1/drafter/config.json").read_text())["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        == 1
    )
    assert "| ttt1 | training.epochs=1, training.optimizer=muon, training.ttt_steps=1 |" in (res / "sweep.md").read_text()
    # the manifest covers the variants' files, each with the job that wrote it
    arts = json.loads((res / "manifest.json").read_text())["artifacts"]
    assert arts["sweep/ttt1/train/summary.json"]["rule"] == "train_drafter_variant"
    assert arts["sweep/ttt1/train/summary.json"]["wildcards"] == {"variant": "ttt1"}
    assert {"vocab/d2t.npy", "hidden_states/shard-00000.safetensors"} <= {
        i["path"] for i in arts["sweep/ttt1/train/summary.json"]["inputs"]
    }
    assert arts["sweep.md"]["rule"] == "sweep_table"


def test_max_train_samples_keeps_the_first_training_samples_and_the_same_validation():
    from types import SimpleNamespace

    from eagle3_pipeline.training import split_items

    readers = [SimpleNamespace(sample_ids=[f"s{i}-{j}" for j in range(40)]) for i in range(2)]
    train, val = split_items(readers, 0.2)
    assert len(train) + len(val) == 80 and 5 < len(val) < 30
    few, val_few = split_items(readers, 0.2, max_train_samples=10)
    assert few == train[:10] and val_few == val
    assert split_items(readers, 0.2, max_train_samples=25)[0][:10] == few  # a smaller N's samples are in a larger N's
    assert split_items(readers, 0.2, max_train_samples=1000)[0] == train


def test_the_plan_counts_the_variants_trainings_and_evaluations(tmp_path):
    from eagle3_pipeline.plan import plan_run

    cfg = _cfg({"ttt2": {"training": {"ttt_steps": 2}}, "k2": {"evaluation": {"num_speculative_tokens": 2}}})
    alone = {s.stage: s for s in plan_run(validate_config({"training": {"epochs": 3}}), None, tmp_path, [], "cpu")[0]}
    jobs = [
        {"rule": "train_drafter_variant", "stage": "train_drafter", "wildcards": {"variant": "ttt2"}, "output": []},
        {"rule": "evaluate_drafter_variant", "stage": "evaluate_drafter", "wildcards": {"variant": "ttt2"}, "output": []},
        {"rule": "evaluate_drafter_variant", "stage": "evaluate_drafter", "wildcards": {"variant": "k2"}, "output": []},
    ]
    got = {s.stage: s for s in plan_run(cfg, None, tmp_path, jobs, "cpu")[0]}
    train, ev = got["train_drafter"], got["evaluate_drafter"]
    assert (train.jobs, train.pending, train.done) == (2, [{"variant": "ttt2"}], False)  # the run's and ttt2's
    # one pending training: half of both, each side rounded to 0.1 s (the half once more)
    assert train.seconds == pytest.approx(alone["train_drafter"].seconds, abs=0.15)
    assert (ev.jobs, len(ev.pending)) == (3, 2) and ev.seconds == pytest.approx(2 * alone["evaluate_drafter"].seconds, abs=0.2)
    assert got["generate_traces"].done and got["extract_hidden_states"].done

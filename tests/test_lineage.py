"""The run manifest (eagle3_pipeline.lineage): hashes recomputed independently, the graph from the
drafter back to the target and the prompt source, schema validation, and verify naming what
changed after the run. Unit tests on a small synthetic run; the end-to-end run's manifest is
checked in test_e2e.py."""

import hashlib
import json
import os
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from eagle3_pipeline.conventions import loss_mask
from eagle3_pipeline.lineage import Hasher, build_manifest, check_manifest, directory_digest, validate_manifest
from eagle3_pipeline.shards import Sample, write_shard
from eagle3_pipeline.target_model import model_fingerprint
from eagle3_pipeline.verify import verify_run


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def make_target(root: Path) -> Path:
    t = root / "target"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": 16}))
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(t / "model.safetensors"))
    (t / ".hidden").write_text("left out")
    return t


def make_run(root: Path) -> tuple[list[dict], dict, Path]:
    """A tiny finished run under root/results/r (every file a stage would write), its jobs and config."""
    target = make_target(root)
    src = root / "prompts.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"}]}) + "\n")
    ev = root / "eval.jsonl"
    ev.write_text(json.dumps({"messages": [{"role": "user", "content": "question"}]}) + "\n")
    run = root / "results" / "r"
    fp = model_fingerprint(target)
    files = {
        "prompts/shard-00000.jsonl": '{"id": "a"}\n',
        "prompts/summary.json": '{"kept": 1}\n',
        "eval/prompts.jsonl": '{"id": "q"}\n',
        "traces/shard-00000.jsonl": json.dumps(
            {
                "id": "a",
                "engine": {"name": "vllm", "version": "0.32.0", "platform": "cpu"},
                "model": {"path": str(target), "fingerprint": fp},
                "sampling": {"seed": 0, "temperature": 0.0, "max_tokens": 8, "top_p": 1.0, "top_k": 0},
            }
        )
        + "\n",
        "vocab/coverage.json": json.dumps({"draft_vocab_size": 4, "target_vocab_size": 16, "coverage": 0.9, "mapping": "built"}),
        "train/summary.json": json.dumps({"steps": 3, "tokens_seen": 30, "train_samples": 1, "val_samples": 0, "final_val": None}),
        "eval/acceptance.json": json.dumps(
            {
                "acceptance_length": 1.5,
                "per_position_acceptance_rate": [0.4, 0.1],
                "accepted_per_position": [4, 1],
                "num_speculative_tokens": 2,
                "num_prompts": 1,
                "num_drafts": 10,
                "draft_acceptance_rate": 0.25,
                "engine": {"name": "vllm", "version": "0.32.0", "platform": "cpu"},
            }
        ),
    }
    for rel, text in files.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    d2t = np.array([0, 1, 3, 9], dtype=np.int64)
    t2d = np.zeros(16, dtype=bool)
    t2d[[0, 2, 5, 12]] = True
    np.save(run / "vocab/d2t.npy", d2t)
    np.save(run / "vocab/t2d.npy", t2d)
    np.save(run / "vocab/token_freq.npy", np.arange(16))
    hs = run / "hidden_states"
    hs.mkdir()
    write_shard(
        hs / "shard-00000.safetensors",
        [Sample("a", np.arange(6), loss_mask(3, 3))],
        [torch.randn(6, 4, 8, dtype=torch.bfloat16)],
        layer_ids=[1, 2, 3, 4],
        aux_layer_ids=[1, 2, 3],
        index_path=hs / "shard-00000.index.json",
    )
    drafter = run / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    save_file({"d2t": d2t, "t2d": t2d, "fc.weight": np.ones((2, 2), dtype=np.float32)}, str(drafter / "model.safetensors"))
    (drafter / ".snakemake_timestamp").write_text("")
    R = "results/r/"
    jobs = [
        {"rule": "prepare_prompts", "wildcards": {}, "inputs": {}, "sources": [{"type": "file", "path": str(src)}, {"type": "file", "path": str(ev)}],
         "outputs": {"shards": [R + "prompts/shard-00000.jsonl"], "summary": [R + "prompts/summary.json"]}},
        {"rule": "prepare_eval_prompts", "wildcards": {}, "inputs": {}, "sources": [{"type": "file", "path": str(ev)}],
         "outputs": {"": [R + "eval/prompts.jsonl"]}},
        {"rule": "generate_traces", "wildcards": {"shard": "00000"}, "sources": [],
         "inputs": {"prompts": [R + "prompts/shard-00000.jsonl"], "target": [str(target)]},
         "outputs": {"traces": [R + "traces/shard-00000.jsonl"]}},
        {"rule": "build_vocab_mapping", "wildcards": {}, "sources": [],
         "inputs": {"traces": [R + "traces/shard-00000.jsonl"], "target": [str(target)]},
         "outputs": {k: [R + f"vocab/{k}.npy"] for k in ("d2t", "t2d", "token_freq")} | {"coverage": [R + "vocab/coverage.json"]}},
        {"rule": "extract_hidden_states", "wildcards": {"shard": "00000"}, "sources": [],
         "inputs": {"traces": [R + "traces/shard-00000.jsonl"], "target": [str(target)]},
         "outputs": {"shard": [R + "hidden_states/shard-00000.safetensors"], "index": [R + "hidden_states/shard-00000.index.json"]}},
        {"rule": "train_drafter", "wildcards": {}, "sources": [],
         "inputs": {"shards": [R + "hidden_states/shard-00000.safetensors"], "d2t": [R + "vocab/d2t.npy"], "t2d": [R + "vocab/t2d.npy"], "target": [str(target)]},
         "outputs": {"drafter": [R + "drafter"], "summary": [R + "train/summary.json"]}},
        {"rule": "evaluate_drafter", "wildcards": {}, "sources": [],
         "inputs": {"drafter": [R + "drafter"], "prompts": [R + "eval/prompts.jsonl"], "target": [str(target)]},
         "outputs": {"acceptance": [R + "eval/acceptance.json"]}},
    ]  # fmt: skip
    config = {
        "run": "r",
        "seed": 0,
        "generation": {"max_tokens": 8},
        "prompts": {"sources": [{"type": "file", "path": str(src)}], "turns": "first", "max_prompts": 10, "num_shards": 1},
        "evaluation": {"prompts": {"type": "file", "path": str(ev)}},
        "training": {"epochs": 1, "lr": 0.001, "init_from": None},
    }
    return jobs, config, target


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # job paths are relative to the working directory, as in a run
    jobs, config, target = make_run(tmp_path)
    return tmp_path, jobs, config, target


def test_directory_digest_is_the_unlimited_model_fingerprint(tmp_path):
    t = make_target(tmp_path)
    files, digest = Hasher().directory(t)
    assert set(files) == {"config.json", "model.safetensors"}  # dot-files left out
    assert files["model.safetensors"] == {"bytes": (t / "model.safetensors").stat().st_size, "sha256": sha(t / "model.safetensors")}
    assert digest == model_fingerprint(t, full_hash_limit_bytes=1 << 40) == directory_digest(files)


def test_manifest_hashes_equal_independent_hashes_and_validate(synthetic):
    root, jobs, config, target = synthetic
    m = build_manifest("results/r", jobs, config, str(target))
    validate_manifest(m)
    run = root / "results" / "r"
    for rel, node in m["artifacts"].items():
        p = run / rel
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            assert node["files"] == {f.relative_to(p).as_posix(): {"bytes": f.stat().st_size, "sha256": sha(f)} for f in files}
            lines = "".join(f"{f.relative_to(p).as_posix()}\0{f.stat().st_size}\0{sha(f)}\n" for f in files)
            assert node["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
        else:
            assert (node["bytes"], node["sha256"]) == (p.stat().st_size, sha(p)), rel
    # every output of every job is an artifact, nothing else
    assert set(m["artifacts"]) == {p.removeprefix("results/r/") for j in jobs for ps in j["outputs"].values() for p in ps}
    assert m["artifacts"]["hidden_states/shard-00000.safetensors"]["hash"] == "index"
    ident = m["identity"]
    assert ident["target"]["fingerprint"] == model_fingerprint(target)
    assert ident["target"]["config_sha256"] == sha(target / "config.json")
    assert ident["target"]["weights"] == {
        "model.safetensors": {"bytes": (target / "model.safetensors").stat().st_size, "sha256": sha(target / "model.safetensors")}
    }
    assert ident["vocab"]["d2t_sha256"] == sha(run / "vocab/d2t.npy") and ident["vocab"]["t2d_sha256"] == sha(run / "vocab/t2d.npy")
    assert ident["drafter"]["weights_sha256"] == sha(run / "drafter/model.safetensors")
    assert ident["layer_ids"] == {"aux_layer_ids": [1, 2, 3], "stored_layer_ids": [1, 2, 3, 4], "drafter_aux_layer_ids": [1, 2, 3]}
    assert ident["prompts"]["sources"] == [
        {"type": "file", "path": config["prompts"]["sources"][0]["path"], "sha256": sha(root / "prompts.jsonl")}
    ]
    assert ident["evaluation"]["acceptance_length"] == 1.5 and ident["sampling"]["seed"] == 0
    assert ident["training"]["config"] == config["training"]
    assert all(c["ok"] for c in m["checks"]), m["checks"]
    assert m["config_sha256"] == hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_drafter_links_back_to_vocab_shards_target_and_prompt_source(synthetic):
    root, jobs, config, target = synthetic
    m = build_manifest("results/r", jobs, config, str(target))
    d = m["artifacts"]["drafter"]
    assert d["rule"] == "train_drafter"
    assert {(i["name"], i["path"], i["sha256"]) for i in d["inputs"]} == {
        ("shards", "hidden_states/shard-00000.safetensors", sha("results/r/hidden_states/shard-00000.safetensors")),
        ("d2t", "vocab/d2t.npy", sha("results/r/vocab/d2t.npy")),
        ("t2d", "vocab/t2d.npy", sha("results/r/vocab/t2d.npy")),
        ("target", str(target), model_fingerprint(target)),
    }
    # follow inputs from the drafter to the end of the graph
    seen, todo = set(), ["drafter"]
    while todo:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        node = m["artifacts"].get(k) or m["external"][k]
        todo += [i["path"] for i in node["inputs"]]
    assert {"traces/shard-00000.jsonl", "prompts/shard-00000.jsonl", str(target), str(root / "prompts.jsonl")} <= seen
    assert m["external"][str(root / "prompts.jsonl")]["sha256"] == sha(root / "prompts.jsonl")
    assert m["external"][str(target)] | {"inputs": []} == {
        "kind": "model",
        "bytes": sum(f.stat().st_size for f in target.iterdir() if not f.name.startswith(".")),
        "sha256": model_fingerprint(target),
        "hash": "model_fingerprint",
        "rule": None,
        "wildcards": {},
        "inputs": [],
    }


def test_shards_are_not_read_again(synthetic, monkeypatch):
    root, jobs, config, target = synthetic
    read = []
    monkeypatch.setattr("eagle3_pipeline.lineage.sha256_file", lambda p, *a: read.append(Path(p).name) or "0" * 64)
    build_manifest("results/r", jobs, config, str(target))
    assert "shard-00000.safetensors" not in read and "shard-00000.jsonl" in read
    assert read.count("model.safetensors") == 2  # the target's weights and the drafter's, each once


def test_failed_checks_are_recorded(synthetic):
    root, jobs, config, target = synthetic
    np.save("results/r/vocab/d2t.npy", np.array([0, 1, 2, 9], dtype=np.int64))  # not the drafter's
    (target / "config.json").write_text("{}")  # the traces' target fingerprint is now stale
    m = build_manifest("results/r", jobs, config, str(target))
    failed = {c["check"] for c in m["checks"] if not c["ok"]}
    assert failed == {"drafter_vocab", "traces_from_target"}


def _second_trace_shard(run: Path, jobs: list[dict], sampling: dict) -> None:
    """A second trace shard beside make_run's, its first record sampled with ``sampling``."""
    first = json.loads((run / "traces/shard-00000.jsonl").read_text())
    (run / "traces/shard-00001.jsonl").write_text(json.dumps(first | {"id": "b", "sampling": sampling}) + "\n")
    job = next(j for j in jobs if j["rule"] == "generate_traces")
    jobs.append(job | {"wildcards": {"shard": "00001"}, "outputs": {"traces": ["results/r/traces/shard-00001.jsonl"]}})


def test_one_sampling_setting_is_the_runs_not_each_requests(synthetic):
    """Sampled shards' first records differ in their per-prompt seed and in a max_tokens lowered to
    their prompt's room: still one sampling setting, the run's (with the configured max_tokens). A
    different temperature in one shard fails the check and lists both."""
    root, jobs, config, target = synthetic
    config["prompts"]["num_shards"] = 2
    run = root / "results" / "r"
    sampled = {"seed": 0, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    (run / "traces/shard-00000.jsonl").write_text(
        json.dumps(
            json.loads((run / "traces/shard-00000.jsonl").read_text()) | {"sampling": sampled | {"max_tokens": 8, "request_seed": 11}}
        )
        + "\n"
    )
    _second_trace_shard(run, jobs, sampled | {"max_tokens": 5, "request_seed": 99})
    m = build_manifest("results/r", jobs, config, str(target))
    assert m["identity"]["sampling"] == sampled | {"max_tokens": 8}
    assert all(c["ok"] for c in m["checks"]), m["checks"]
    _second_trace_shard(run, jobs[:-1], sampled | {"temperature": 1.0, "max_tokens": 8, "request_seed": 99})
    m = build_manifest("results/r", jobs, config, str(target))
    assert [c["check"] for c in m["checks"] if not c["ok"]] == ["one_sampling"]
    assert m["identity"]["sampling"] == [sampled | {"max_tokens": 8}, sampled | {"temperature": 1.0, "max_tokens": 8}]


def test_schema_rejects_a_broken_manifest(synthetic):
    root, jobs, config, target = synthetic
    m = build_manifest("results/r", jobs, config, str(target))
    bad = json.loads(json.dumps(m))
    bad["artifacts"]["drafter"]["sha256"] = "xyz"
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(bad)
    bad = json.loads(json.dumps(m))
    del bad["identity"]["vocab"]["d2t_sha256"]
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(bad)


def test_verify_names_what_changed_after_the_run(synthetic):
    from eagle3_pipeline.lineage import write_manifest

    root, jobs, config, target = synthetic
    write_manifest("results/r/manifest.json", build_manifest("results/r", jobs, config, str(target)))
    shards = (["results/r/traces/shard-00000.jsonl"], ["results/r/hidden_states/shard-00000.safetensors"])
    (root / "results/r/traces/shard-00000.summary.json").write_text(
        json.dumps({"ok": 1, "traces_sha256": sha("results/r/traces/shard-00000.jsonl")})
    )
    m = json.loads((root / "results/r/manifest.json").read_text())
    assert verify_run(*shards, "results/r/manifest.json") == {
        "checked": 2,
        "traces": 1,
        "hidden_states": 1,
        "manifest": "checked",
        "manifest_entries": len(m["artifacts"]) + len(m["external"]),
        "problems": [],
    }
    assert verify_run(*shards, "results/r/absent.json")["manifest"] == "absent"
    # a drafter replaced after the run, a file added to it, the target edited, a prompt source edited
    w = root / "results/r/drafter/model.safetensors"
    w.write_bytes(w.read_bytes()[:-1] + b"\x01")
    (root / "results/r/drafter/extra.bin").write_bytes(b"x")
    (target / "generation_config.json").write_text("{}")
    (root / "prompts.jsonl").write_text("{}\n")
    os.remove(root / "results/r/vocab/token_freq.npy")
    problems = verify_run(*shards, "results/r/manifest.json")["problems"]
    assert any(p.startswith("results/r/drafter/model.safetensors: sha256") for p in problems), problems
    assert "results/r/drafter/extra.bin: not in the run manifest" in problems
    assert any(p.startswith(f"{target}: model fingerprint") for p in problems)
    assert any(p.startswith(f"{root / 'prompts.jsonl'}: ") and "bytes" in p for p in problems)
    assert "results/r/vocab/token_freq.npy: missing (the run manifest lists it)" in problems
    assert len(problems) == 6  # the source's size and its hash; nothing else
    assert check_manifest("results/r/nope.json") == ["results/r/nope.json: missing"]


def test_the_manifest_records_the_bytes_on_disk_and_fails_its_check_for_an_altered_shard(synthetic):
    root, jobs, config, target = synthetic
    shard = root / "results/r/hidden_states/shard-00000.safetensors"
    recorded = json.loads(shard.with_name("shard-00000.index.json").read_text())["sha256"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one byte, same size
    shard.write_bytes(bytes(data))
    m = build_manifest("results/r", jobs, config, str(target))
    node = m["artifacts"]["hidden_states/shard-00000.safetensors"]
    assert node["sha256"] == sha(shard) != recorded and node["hash"] == "sha256"
    (check,) = [c for c in m["checks"] if not c["ok"]]
    assert check["check"] == "shard_index"
    assert f"sha256 {sha(shard)}" in check["detail"] and f"its index recorded {recorded}" in check["detail"]
    # the drafter's input is the bytes on disk too
    assert {i["sha256"] for i in m["artifacts"]["drafter"]["inputs"] if i["name"] == "shards"} == {sha(shard)}


def test_lineage_jobs_are_the_jobs_the_targets_need_from_the_rules_declared_files():
    from types import SimpleNamespace

    from snakemake.iocontainers import Namedlist

    from eagle3_pipeline.snakemake_adapter import lineage_jobs

    def files(*items, **named):
        nl = Namedlist(list(items) + list(named.values()))
        for i, name in enumerate(named):
            nl._set_name(name, len(items) + i)
        return nl

    def vocab(wc):
        return {"d2t": f"r/sweep/{wc.variant}/d2t.npy"}

    rules = SimpleNamespace(
        model=SimpleNamespace(input=files(), output=files("m")),
        unused=SimpleNamespace(input=files(), output=files("x")),  # nothing reads it
        shard=SimpleNamespace(input=files(model="m"), output=files(out="r/s-{shard}.st")),
        vocab_v=SimpleNamespace(input=files(), output=files(d2t="r/sweep/{variant}/d2t.npy")),
        train_v=SimpleNamespace(
            input=files(vocab, shards=lambda wc: ["r/s-0.st", "r/s-1.st"]), output=files(drafter="r/sweep/{variant}/drafter")
        ),
        report=SimpleNamespace(input=files(), output=files()),  # no outputs (like rule all): never a job
    )
    # a variant's rule runs its stage's script: its sources are asked by that stage, with its wildcards
    workflow = SimpleNamespace(rules=[SimpleNamespace(name=n, script="s/train.py" if n == "train_v" else None) for n in vars(rules)])
    jobs = lineage_jobs(
        workflow, rules, ["r/sweep/a/drafter"], {"shard": ["0", "1"], "variant": ["a", "b"]}, lambda stage, wc: [{"stage": stage} | wc]
    )
    assert [(j["rule"], j["wildcards"]) for j in jobs] == [
        ("model", {}),
        ("shard", {"shard": "0"}),
        ("shard", {"shard": "1"}),
        ("vocab_v", {"variant": "a"}),
        ("train_v", {"variant": "a"}),
    ]
    train = jobs[-1]
    assert train["inputs"] == {"shards": ["r/s-0.st", "r/s-1.st"], "d2t": ["r/sweep/a/d2t.npy"]}
    assert train["outputs"] == {"drafter": ["r/sweep/a/drafter"]} and train["sources"] == [{"stage": "train", "variant": "a"}]
    assert jobs[0]["outputs"] == {"": ["m"]} and jobs[1]["inputs"] == {"model": ["m"]}
    # the manifest's inputs: every output of those jobs, once each
    from eagle3_pipeline.lineage import lineage_outputs

    assert lineage_outputs(jobs + jobs[:1]) == sorted(p for j in jobs for ps in j["outputs"].values() for p in ps)
    assert "r/sweep/a/drafter" in lineage_outputs(jobs) and lineage_outputs([]) == []
    # what the manifest needs: the outputs no job reads (the model feeds the shards, the shards and
    # the variant's vocabulary the training), after which every job has run
    from eagle3_pipeline.lineage import lineage_terminals

    assert lineage_terminals(jobs) == ["r/sweep/a/drafter"]
    with_rejects = [
        j | {"outputs": j["outputs"] | {"rejects": [f"r/rej-{j['wildcards']['shard']}"]}} if j["rule"] == "shard" else j for j in jobs
    ]
    assert lineage_terminals(with_rejects) == ["r/rej-0", "r/rej-1", "r/sweep/a/drafter"]


def test_external_sources_are_what_a_rule_reads_by_config():
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.lineage import external_sources
    from eagle3_pipeline.sweep import variant_configs

    cfg = validate_config(
        {"training": {"init_from": "old/drafter"}, "sweep": {"variants": {"v": {"training": {"init_from": "v/drafter"}}}}}
    )
    variants = variant_configs(cfg)
    prompts = cfg["prompts"]["sources"]
    assert external_sources(cfg, variants, "prepare_prompts") == [*prompts, {"type": "builtin_mtbench"}]
    assert external_sources(cfg, variants, "train_drafter") == [{"type": "drafter", "path": "old/drafter"}]
    # a variant's job reads its own warm start
    assert external_sources(cfg, variants, "train_drafter", {"variant": "v"}) == [{"type": "drafter", "path": "v/drafter"}]
    assert external_sources(cfg, variants, "build_vocab_mapping", {"variant": "v"}) == [{"type": "drafter", "path": "v/drafter"}]
    assert external_sources(cfg, variants, "prepare_target_model") == [{"type": "builtin_target"}]
    plain = validate_config({})
    assert external_sources(plain, {}, "build_vocab_mapping") == [] == external_sources(cfg, variants, "summarize_run")

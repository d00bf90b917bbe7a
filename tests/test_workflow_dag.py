"""DAG-level checks through the snakemake CLI (dry-runs only: seconds)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.workflow


def snakemake(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True, text=True)


def test_kimi_example_dry_runs_with_tp8_full_model_jobs(tmp_path):
    # a stand-in for the 547 GB checkpoint: what the DAG needs (config, weights listing, template)
    target = tmp_path / "Kimi-K2.5"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840})
    )
    (target / "model-00001-of-00064.safetensors").write_bytes(b"")
    (target / "chat_template.jinja").write_text("{{ messages }}")
    over = tmp_path / "over.yaml"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    over.write_text(
        yaml.safe_dump(
            {"target": {"path": str(target), "trust_remote_code": True}, "prompts": {"sources": [{"type": "file", "path": str(prompts)}]}}
        )
    )
    r = snakemake(
        "-n",
        "--cores",
        "64",
        "--configfile",
        "config/examples/kimi-k2.5-8gpu.yaml",
        str(over),
        "-d",
        str(tmp_path / "wd"),
        "-s",
        str(ROOT / "Snakefile"),
    )
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout
    assert "prepare_target_model" not in out  # a user target is not materialized
    for rule in (
        "prepare_prompts",
        "generate_traces",
        "build_vocab_mapping",
        "extract_hidden_states",
        "train_drafter",
        "evaluate_drafter",
        "summarize_run",
        "plot_run",  # the report's figures are part of the default target
        "write_manifest",  # so is the run manifest
    ):
        assert rule in out
    blocks = re.split(r"^\[.*\d{4}\]$", out, flags=re.M)  # one block per job, after its timestamp line
    gen = next(b for b in blocks if "rule generate_traces:" in b)
    assert "gpu=8" in gen and "full_model=1" in gen and "rule extract_hidden_states:" not in gen
    # extraction prefills the INT4 weights in vLLM, tensor parallel 8 (the hf backend would dequantize them)
    ext = next(b for b in blocks if "rule extract_hidden_states:" in b)
    assert "gpu=8" in ext and "full_model=1" in ext


def test_typo_in_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("vocab:\n  draft_vocab_sise: 100\n")
    r = snakemake("-n", "--cores", "1", "--configfile", str(bad), "-d", str(tmp_path / "wd"), "-s", str(ROOT / "Snakefile"))
    assert r.returncode != 0
    assert "vocab: Additional properties are not allowed ('draft_vocab_sise' was unexpected)" in r.stdout + r.stderr


def test_vllm_extraction_replica_is_one_engine(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"extraction": {"backend": "vllm", "gpus_per_replica": 2}}))
    r = snakemake("-n", "--cores", "1", "--configfile", str(cfg), "-d", str(tmp_path / "wd"), "-s", str(ROOT / "Snakefile"))
    assert r.returncode != 0
    assert "extraction.gpus_per_replica=2 but the vllm backend's replica is one engine" in r.stdout + r.stderr
    cfg.write_text(yaml.safe_dump({"extraction": {"backend": "vllm"}, "vllm": {"tensor_parallel_size": 2}}))
    r = snakemake("-n", "--cores", "1", "--configfile", str(cfg), "-d", str(tmp_path / "wd"), "-s", str(ROOT / "Snakefile"))
    assert r.returncode == 0, r.stderr + r.stdout
    assert re.search(r"rule extract_hidden_states:(?:(?!rule ).)*gpu=2", r.stdout, flags=re.S)


def test_replicas_sharing_gpus_ask_for_fewer_gpus(tmp_path):
    """data_parallel_size 4 with 2 replicas per GPU: generation and vllm extraction jobs take 2 GPUs."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"extraction": {"backend": "vllm"}, "vllm": {"data_parallel_size": 4, "replicas_per_gpu": 2}}))
    r = snakemake("-n", "--cores", "1", "--configfile", str(cfg), "-d", str(tmp_path / "wd"), "-s", str(ROOT / "Snakefile"))
    assert r.returncode == 0, r.stderr + r.stdout
    for rule in ("generate_traces", "extract_hidden_states"):
        assert re.search(rf"rule {rule}:(?:(?!rule ).)*gpu=2,", r.stdout, flags=re.S), rule


def test_missing_target_dir_is_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"path": str(tmp_path / "nope")}}))
    r = snakemake("-n", "--cores", "1", "--configfile", str(cfg), "-d", str(tmp_path / "wd"), "-s", str(ROOT / "Snakefile"))
    assert r.returncode != 0
    assert f"target.path: target model directory {tmp_path / 'nope'} does not exist" in r.stdout + r.stderr


def test_editing_a_prompt_file_in_place_reruns_prepare_prompts(tmp_path):
    """Content-aware, not mtime-aware: the file changes while its mtime is put back."""
    import os

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "What is a monad?"}]}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": "t", "prompts": {"sources": [{"type": "file", "path": str(src)}], "max_prompts": None}}))
    target = "results/t/prompts/summary.json"
    args = [
        "--cores",
        "1",
        "--configfile",
        str(ROOT / "config/config.yaml"),
        str(cfg),
        "-d",
        str(tmp_path / "wd"),
        "-s",
        str(ROOT / "Snakefile"),
        target,
    ]
    r = snakemake(*args)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "wd" / target).read_text())["kept"] == 1
    assert "Nothing to be done" in snakemake("-n", *args).stdout
    st = src.stat()
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "What is a functor?"}]}) + "\n")
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = snakemake("-n", *args).stdout
    assert "rule prepare_prompts:" in out and "params have changed" in out


def test_full_model_lock_survives_other_resources(tmp_path):
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    with SnakemakeApi(OutputSettings()) as api:
        wf = api.workflow(
            resource_settings=ResourceSettings(cores=4, resources={"mem_gb": 64}),
            config_settings=ConfigSettings(configfiles=[ROOT / "config" / "config.yaml"]),
            snakefile=ROOT / "Snakefile",
            workdir=tmp_path,
        )
        workflow = wf._workflow  # the parsed Snakefile (includes rules/common.smk)
        assert workflow.global_resources["full_model"] == 1
        assert workflow.global_resources["mem_gb"] == 64
        for name in ("generate_traces", "extract_hidden_states", "evaluate_drafter"):
            assert workflow.get_rule(name).resources["full_model"] == 1


def test_two_gpu_example_gives_each_job_the_gpus_it_uses(tmp_path):
    """Data parallel 2 (generation, extraction), 1 engine for evaluation, DDP on 2 GPUs; one job per shard."""
    r = snakemake(
        "-n",
        "--cores",
        "32",
        "--configfile",
        "config/examples/smollm2-2gpu.yaml",
        "-d",
        str(tmp_path / "wd"),
        "-s",
        str(ROOT / "Snakefile"),
    )
    assert r.returncode == 0, r.stderr + r.stdout
    blocks = re.split(r"^\[.*\d{4}\]$", r.stdout, flags=re.M)  # one block per job, after its timestamp line

    def jobs(rule):
        return [b for b in blocks if f"rule {rule}:" in b]

    assert len(jobs("generate_traces")) == len(jobs("extract_hidden_states")) == 4
    assert all("gpu=2" in b and "full_model=1" in b for b in jobs("generate_traces") + jobs("extract_hidden_states"))
    assert "gpu=1" in jobs("evaluate_drafter")[0] and "gpu=2" in jobs("train_drafter")[0]


def test_one_gpu_example_runs_every_stage_on_the_one_gpu(tmp_path):
    """config/examples/smollm2-h200.yaml (the measured H200 run): one job per stage, each on 1 GPU."""
    r = snakemake(
        "-n",
        "--cores",
        "16",
        "--configfile",
        "config/examples/smollm2-h200.yaml",
        "-d",
        str(tmp_path / "wd"),
        "-s",
        str(ROOT / "Snakefile"),
    )
    assert r.returncode == 0, r.stderr + r.stdout
    blocks = re.split(r"^\[.*\d{4}\]$", r.stdout, flags=re.M)
    for rule in ("generate_traces", "extract_hidden_states", "evaluate_drafter"):
        (job,) = [b for b in blocks if f"rule {rule}:" in b]
        assert "gpu=1" in job and "full_model=1" in job, job
    (train,) = [b for b in blocks if "rule train_drafter:" in b]
    assert "gpu=1" in train and "full_model=1" not in train, train  # training shares no lock without sweep variants


def test_evaluation_enforce_eager_sets_only_the_evaluation_engine(tmp_path):
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    over = tmp_path / "eager.yaml"
    over.write_text("vllm: {enforce_eager: false}\nextraction: {backend: vllm}\nevaluation: {enforce_eager: true}\n")
    with SnakemakeApi(OutputSettings()) as api:
        wf = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[ROOT / "config" / "config.yaml", over]),
            snakefile=ROOT / "Snakefile",
            workdir=tmp_path,
        )
        workflow = wf._workflow
        assert workflow.get_rule("evaluate_drafter").params.vllm["enforce_eager"] is True
        assert workflow.get_rule("generate_traces").params.vllm["enforce_eager"] is False
        assert workflow.get_rule("extract_hidden_states").params.extraction["engine"]["enforce_eager"] is False


def test_a_failed_run_says_rerun_resumes_and_what_it_keeps(tmp_path):
    """onerror: after a failed job, the run names the finished chunks it keeps and says to rerun."""
    src = tmp_path / "p.jsonl"
    src.write_text('{"messages": "not a list"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": "r", "prompts": {"sources": [{"type": "file", "path": str(src)}]}}))
    kept = tmp_path / "wd" / "results" / "r" / "traces" / ".shard-00000.jsonl.partial"
    kept.mkdir(parents=True)
    (kept / "chunk-000000.jsonl").write_text("{}\n")
    r = snakemake(
        "--cores",
        "1",
        "--configfile",
        str(cfg),
        "-d",
        str(tmp_path / "wd"),
        "-s",
        str(ROOT / "Snakefile"),
        "results/r/prompts/shard-00000.jsonl",
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Error in rule prepare_prompts" in out
    assert "The run stopped before it finished. Rerun the same command to resume: kept for the rerun," in out
    assert "1 finished chunk(s) of results/r/traces/shard-00000.jsonl" in out


def test_incomplete_outputs_are_those_a_killed_snakemake_left(tmp_path):
    """snakemake SIGKILLed while its job runs leaves the job's output marked incomplete: the onstart
    hook's view of those marks (snakemake_adapter.incomplete_outputs, Snakemake internals) names it,
    and not the output of a job that ended."""
    import os
    import signal
    import time

    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import DAGSettings, ExecutionSettings, OutputSettings, ResourceSettings

    from eagle3_pipeline.snakemake_adapter import incomplete_outputs

    (tmp_path / "Snakefile").write_text(
        'rule all:\n    input: "a.txt", "b.txt"\n'
        'rule a:\n    output: "a.txt"\n    shell: "echo a > {output}"\n'
        'rule b:\n    input: "a.txt"\n    output: b="b.txt", d=directory("d")\n'
        '    shell: "mkdir -p {output.d}; echo b > {output.b}; sleep 120"\n'
    )  # a folder output as training's drafter
    snake = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "-c1", "-s", "Snakefile"], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "b.txt").exists():
        assert snake.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(snake.pid, signal.SIGKILL)  # snakemake and its job's shell
    snake.wait()
    (tmp_path / "a.txt").unlink()  # job a runs again too, its output not marked
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=tmp_path / "Snakefile", workdir=tmp_path)
        dag = wf.dag(DAGSettings(force_incomplete=True))
        dag.execute_workflow(executor="local", pseudo_executor="dryrun", execution_settings=ExecutionSettings(lock=False))
        assert {j.rule.name for j in wf._workflow.dag.needrun_jobs(exclude_finished=False)} == {"a", "b", "all"}
        assert incomplete_outputs(wf._workflow) == {"b.txt", "d"}


def test_a_target_the_engine_cannot_take_stops_the_run_before_any_job(tmp_path, target_dir):
    """onstart: a Gemma-3 target (vLLM's class has no EAGLE-3 support), a target whose context is shorter
    than max_seq_len, one whose tokenizer.json is cut short and one whose config.json has more layers
    than its weights stop the run before any job, also before prepare_prompts (on a cluster: before
    anything is queued), naming the target and what to do; `-n` still only plans."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    gemma3 = tmp_path / "gemma3"
    cfg = AutoConfig.for_model("gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2)
    cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size = 1, 32, 16000
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(gemma3)
    short = tmp_path / "short"
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2)
    cfg.vocab_size, cfg.max_position_embeddings = 16000, 512
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(short)
    notok = tmp_path / "notok"
    cfg.max_position_embeddings = 4096
    cfg.save_pretrained(notok)
    for target in (gemma3, short, notok):
        # the DAG lists the weights and the template; the check reads the config (vLLM: and the weights' header)
        save_file({"lm_head.weight": torch.zeros(2, 2)}, target / "model.safetensors")
    mismatch = tmp_path / "mismatch"  # whole weights of 8 layers; config.json then says 9
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2)
    cfg.vocab_size, cfg.architectures = 16000, ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_config(cfg).save_pretrained(mismatch)
    (mismatch / "config.json").write_text(json.dumps(json.loads((mismatch / "config.json").read_text()) | {"num_hidden_layers": 9}))
    for target in (gemma3, short, notok, mismatch):
        for f in target_dir.iterdir():  # a tokenizer that renders prompts
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, target)
    (notok / "tokenizer.json").write_text((target_dir / "tokenizer.json").read_text()[:1000])
    for target, says in (
        (gemma3, "Gemma3ForCausalLM has no EAGLE-3 support"),
        (short, "max_seq_len"),
        (notok, "tokenizer.json (line "),
        (mismatch, "config.json has 9 hidden layers; no weights for layer(s) 8 "),
    ):
        run = tmp_path / target.name
        conf = tmp_path / f"{target.name}.yaml"
        conf.write_text(
            yaml.safe_dump({"run": "r", "target": {"path": str(target)}, "prompts": {"sources": [{"type": "file", "path": str(prompts)}]}})
        )
        args = ("--cores", "1", "--configfile", str(conf), "-d", str(run), "-s", str(ROOT / "Snakefile"))
        assert snakemake("-n", *args).returncode == 0  # a dry-run plans without the check
        r = snakemake(*args)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and str(target) in out and says in out and "Checked at the run's start: nothing was run." in out, out[
            -3000:
        ]
        assert "rule prepare_prompts" not in out and not (run / "results").exists() and not (run / "logs").exists()
    # `snakemake plan` says it before the user starts the run: it still plans, and fails
    r = snakemake(*args, "plan")
    assert r.returncode != 0, r.stderr[-3000:]
    assert "A run with this config would stop at its start, before any job:\n" in r.stderr and says in r.stderr
    before, after = r.stderr.split("A run with this config would stop at its start")[:2]
    assert "total (pending stages)" in before and "exits with status 1" in after
    assert "Rerun the same command to resume" not in after  # nothing to resume
    assert json.loads((run / "results/r/plan.json").read_text())["refused_at_start"].startswith(f"{target}: ")

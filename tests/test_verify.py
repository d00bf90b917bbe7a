"""The verify target names missing, truncated and altered shards."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from e2e_support import snakemake_cli

# imported here, not inside a test: Snakemake's first import keeps the streams it finds, and a capsys
# test's have no file descriptor, which the e2e run's jobs (made later in that case) then lack
from snakemake.exceptions import WorkflowError

from eagle3_pipeline.conventions import loss_mask
from eagle3_pipeline.io import sha256_file
from eagle3_pipeline.shards import Sample, write_shard
from eagle3_pipeline.snakemake_adapter import check_pending_inputs
from eagle3_pipeline.verify import summary_lines, verify_run

ROOT = Path(__file__).resolve().parents[1]


def make_run(tmp_path, hidden_dir=None):
    hidden_dir = hidden_dir or tmp_path
    traces = tmp_path / "shard-00000.jsonl"
    traces.write_text('{"id": "a"}\n{"id": "b"}\n')
    (tmp_path / "shard-00000.summary.json").write_text(json.dumps({"ok": 2, "traces_sha256": sha256_file(traces)}))
    samples = [Sample("a", np.arange(6), loss_mask(3, 3)), Sample("b", np.arange(4), loss_mask(2, 2))]
    states = [torch.randn(6, 2, 8, dtype=torch.bfloat16), torch.randn(4, 2, 8, dtype=torch.bfloat16)]
    hs = hidden_dir / "shard-00000.safetensors"
    write_shard(hs, samples, states, layer_ids=[2, 30], aux_layer_ids=[2], index_path=hidden_dir / "shard-00000.index.json")
    return traces, hs


def test_intact_run_verifies(tmp_path):
    traces, hs = make_run(tmp_path)
    res = verify_run([str(traces)], [str(hs)])
    assert res == {"checked": 2, "traces": 1, "hidden_states": 1, "manifest": None, "manifest_entries": 0, "problems": []}
    assert summary_lines(res) == [
        "verify ok: all 2 shards match their manifests: 1 trace and 1 hidden-state shards (record and token counts, SHA-256)"
    ]
    absent = verify_run([str(traces)], [str(hs)], str(tmp_path / "manifest.json"))
    assert summary_lines(absent, "m.json")[1] == "verify: no run manifest m.json yet (written at the end of a run); shards only"


def test_verifying_a_run_that_never_started_here_says_so_once(tmp_path):
    """`snakemake verify` without the run's --configfile checks the default run: with none of its
    shards and no manifest it says the run has not started here and how to name another, once,
    instead of calling each shard missing and telling to force-rerun it."""
    run = tmp_path / "results" / "default"
    shards = [str(run / "traces" / "shard-00000.jsonl")], [str(run / "hidden_states" / "shard-00000.safetensors")]
    res = verify_run(*shards, str(run / "manifest.json"))
    assert res["no_run"] and res["checked"] == 0 and len(res["problems"]) == 1
    (line,) = summary_lines(res, str(run / "manifest.json"))
    assert line.startswith(f"verify FAILED: nothing to verify: no shard of this run and no run manifest under {run} ")
    assert "`snakemake verify --configfile <its config>`" in line and "--forcerun" not in line
    traces, _ = make_run(tmp_path)  # one shard there: each missing one is named as before
    res = verify_run([str(traces)], shards[1])
    assert "no_run" not in res and res["problems"] == [f"{shards[1][0]}: missing"]


@pytest.mark.workflow
def test_snakemake_verify_prints_its_summary_on_the_console(tmp_path):
    """Before, the script sent everything to logs/<run>/verify.log: a passing verify printed nothing."""
    wd = tmp_path / "wd"
    res = wd / "results/v"
    (res / "traces").mkdir(parents=True)
    (res / "hidden_states").mkdir()
    make_run(res / "traces", res / "hidden_states")
    cfg = tmp_path / "v.yaml"
    cfg.write_text(yaml.safe_dump({"run": "v", "prompts": {"num_shards": 1}}))
    r = snakemake_cli(wd, cfg, "--cores", "1", targets=("verify",), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    ok = "verify ok: all 2 shards match their manifests: 1 trace and 1 hidden-state shards (record and token counts, SHA-256)"
    assert ok in r.stderr and ok in (wd / "logs/v/verify.log").read_text()
    assert "no run manifest results/v/manifest.json yet" in r.stderr
    (res / "traces/shard-00000.jsonl").write_text('{"id": "a"}\n')
    r = snakemake_cli(wd, cfg, "--cores", "1", targets=("verify",), cwd=ROOT)
    assert r.returncode != 0
    assert "verify FAILED: 2 problem(s) in 1 trace and 1 hidden-state shards" in r.stderr
    assert "Each file listed: remake it, and everything made from it, with `snakemake --forcerun <file>`" in r.stderr
    assert "Rerun the same command to resume" not in r.stderr + r.stdout  # a rerun does not mend altered files


def test_truncated_hidden_state_shard_is_named(tmp_path):
    traces, hs = make_run(tmp_path)
    data = hs.read_bytes()
    hs.write_bytes(data[: len(data) - 100])
    problems = verify_run([str(traces)], [str(hs)])["problems"]
    assert any(str(hs) in p and "truncated" in p for p in problems)
    assert any("unreadable" in p for p in problems)


def test_altered_and_missing_trace_shards_are_named(tmp_path):
    traces, hs = make_run(tmp_path)
    traces.write_text('{"id": "a"}\n')
    problems = verify_run([str(traces), str(tmp_path / "shard-00001.jsonl")], [str(hs)])["problems"]
    assert any("sha256" in p and str(traces) in p for p in problems)
    assert any("1 records, the manifest says 2" in p for p in problems)
    assert f"{tmp_path / 'shard-00001.jsonl'}: missing" in problems


def test_damaged_records_are_named_and_the_other_shards_still_checked(tmp_path):
    """A cut index, an index that is not an object and a cut trace summary each name their file
    and what to do; verify used to stop at the first with a raw JSONDecodeError."""
    traces, hs = make_run(tmp_path)
    other = tmp_path / "two"
    other.mkdir()
    traces2, hs2 = make_run(other)
    index = tmp_path / "shard-00000.index.json"
    index.write_text(index.read_text()[:40])
    (other / "shard-00000.index.json").write_text("[]")
    summary = other / "shard-00000.summary.json"
    summary.write_text(summary.read_text()[:10])
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"artifacts": {')
    res = verify_run([str(traces), str(traces2)], [str(hs), str(hs2)], str(manifest))
    assert len(res["problems"]) == 4 and res["checked"] == 4, res["problems"]
    cut_summary, cut, listed, cut_manifest = res["problems"]  # trace shards, hidden-state shards, the manifest
    assert cut.startswith(f"{index}: unreadable record (") and f"--forcerun {hs}" in cut
    assert listed.startswith(f"{other / 'shard-00000.index.json'}: not a JSON object")
    assert cut_summary.startswith(f"{summary}: unreadable record (") and f"--forcerun {traces2}" in cut_summary
    assert cut_manifest.startswith(f"{manifest}: unreadable record (")


# --- consumers check what their producers recorded -----------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    """Change one byte in place (same size), as an edit or a damaged disk would."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_recorded_hash_is_trusted_only_while_the_file_is_unwritten(tmp_path, monkeypatch):
    import os

    import pytest

    from eagle3_pipeline import io
    from eagle3_pipeline.io import InputError, checked_sha256, file_stat

    f = tmp_path / "x.bin"
    f.write_bytes(b"abc" * 1000)
    digest, stat = sha256_file(f), file_stat(f)
    reads = []
    monkeypatch.setattr(io, "sha256_file", lambda p, *a: reads.append(p) or sha256_file(p))
    assert checked_sha256(f, digest, stat, "rec.json") == digest and reads == []  # unwritten since: not read
    os.utime(f, ns=(stat["mtime_ns"] + 10**9, stat["mtime_ns"] + 10**9))  # touched (or copied): read once, equal
    assert checked_sha256(f, digest, stat, "rec.json") == digest and len(reads) == 1
    assert checked_sha256(f, digest, None, "rec.json") == digest and len(reads) == 1  # same bytes and stat: hashed once per process
    _flip_byte(f, 5)
    with pytest.raises(InputError) as e:
        checked_sha256(f, digest, stat, "rec.json")
    assert f"{f}: its bytes differ from what its producer recorded in rec.json" in str(e.value)
    assert f"sha256 {sha256_file(f)} on disk, {digest} recorded" in str(e.value) and f"`snakemake --forcerun {f}`" in str(e.value)


def _train_small(tmp_path, shard, target_dir):
    """train() on ``shard`` and ``tmp_path/vocab``: 1 epoch of AdamW (it stops at its input checks here)."""
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import train

    cfg = validate_config({"training": {"epochs": 1, "pack_tokens": 256, "optimizer": "adamw"}})["training"]
    train(
        [str(shard)], str(tmp_path / "vocab"), str(target_dir), str(tmp_path / "d"), str(tmp_path / "m.jsonl"), cfg, seed=0, max_seq_len=256
    )


def test_training_refuses_a_shard_altered_after_extraction(tmp_path, target_dir):
    import pytest
    from train_support import write_random_train_inputs

    from eagle3_pipeline.io import InputError

    shard = write_random_train_inputs(tmp_path, 4)
    index = json.loads((tmp_path / "shard-00000.index.json").read_text())
    _flip_byte(shard, shard.stat().st_size - 3)  # inside the last tensor's bytes: still a readable shard
    with pytest.raises(
        InputError,
        match=rf"its bytes differ .* recorded in {tmp_path / 'shard-00000.index.json'}: sha256 [0-9a-f]{{64}} on disk, {index['sha256']} recorded",
    ):
        _train_small(tmp_path, shard, target_dir)
    assert not (tmp_path / "d").exists()


def test_extraction_refuses_traces_altered_after_generation(tmp_path):
    import pytest

    from eagle3_pipeline.generation import recorded_traces_sha256
    from eagle3_pipeline.io import InputError, file_stat

    traces = tmp_path / "shard-00000.jsonl"
    traces.write_text('{"id": "a"}\n')
    (tmp_path / "shard-00000.summary.json").write_text(json.dumps({"traces_sha256": sha256_file(traces), "traces_stat": file_stat(traces)}))
    assert recorded_traces_sha256(traces) == sha256_file(traces)
    traces.write_text('{"id": "b"}\n')
    with pytest.raises(
        InputError, match=r"shard-00000.jsonl: its bytes differ from what its producer recorded in .*shard-00000.summary.json"
    ):
        recorded_traces_sha256(traces)


def test_a_directory_record_names_an_altered_or_missing_file(tmp_path):
    import pytest

    from eagle3_pipeline.io import InputError, check_recorded_files, record_files

    d = tmp_path / "drafter"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "model.safetensors").write_bytes(b"weights" * 100)
    (d / ".hidden").write_text("not recorded")
    assert check_recorded_files(d) is None  # no record: nothing to check against
    rec = record_files(d)
    assert sorted(rec) == ["config.json", "sub/model.safetensors"]
    assert check_recorded_files(d) == {k: sha256_file(d / k) for k in rec}
    _flip_byte(d / "sub" / "model.safetensors", 3)
    with pytest.raises(InputError, match=r"sub/model.safetensors: its bytes differ from what its producer recorded in .*\.sha256\.json"):
        check_recorded_files(d)
    with pytest.raises(InputError, match=rf"`snakemake --forcerun {d}`"):  # the job's output is the directory
        check_recorded_files(d)
    with pytest.raises(InputError, match=rf"`snakemake --forcerun {d / 'sub' / 'model.safetensors'}`"):  # each file is one
        check_recorded_files(d, directory_output=False)
    (d / "sub" / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"model.safetensors: missing, but .*\.sha256\.json records it"):
        check_recorded_files(d)


def test_training_refuses_a_draft_vocab_altered_after_it_was_built(tmp_path, target_dir):
    import numpy as np
    import pytest
    from train_support import write_random_train_inputs

    from eagle3_pipeline.io import InputError, record_files

    shard = write_random_train_inputs(tmp_path, 4)
    record_files(tmp_path / "vocab", ["d2t.npy", "t2d.npy"])  # as build_vocab_mapping does
    d2t = np.load(tmp_path / "vocab" / "d2t.npy")
    d2t[5] += 1
    np.save(tmp_path / "vocab" / "d2t.npy", d2t)
    with pytest.raises(InputError, match=r"vocab/d2t.npy: its bytes differ from what its producer recorded") as e:
        _train_small(tmp_path, shard, target_dir)
    assert f"`snakemake --forcerun {tmp_path / 'vocab' / 'd2t.npy'}`" in str(e.value)  # a job output (the folder is not one)


def test_an_edit_that_sets_the_mtime_back_is_still_caught(tmp_path):
    """Size, mtime and inode kept (an in-place edit, then utime): the status-change time moved."""
    import os
    import time

    import pytest

    from eagle3_pipeline.io import InputError, checked_sha256, file_stat

    f = tmp_path / "x.bin"
    f.write_bytes(b"abc" * 1000)
    digest, stat = sha256_file(f), file_stat(f)
    time.sleep(0.01)
    with open(f, "r+b") as h:  # same inode, same size
        h.seek(10)
        h.write(b"Z")
    os.utime(f, ns=(stat["mtime_ns"], stat["mtime_ns"]))
    assert {k: v for k, v in file_stat(f).items() if k != "ctime_ns"} == {k: v for k, v in stat.items() if k != "ctime_ns"}
    with pytest.raises(InputError, match="its bytes differ"):
        checked_sha256(f, digest, stat, "rec.json")


def test_records_without_a_hash_or_malformed_are_named_not_misread(tmp_path):
    import pytest

    from eagle3_pipeline.io import InputError, check_recorded_files, checked_sha256, record_files

    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    with pytest.raises(InputError, match=r"x.bin: idx.json records no SHA-256 for it \(written without a checksum"):
        checked_sha256(f, None, None, "idx.json")
    d = tmp_path / "d"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w")
    record_files(d)
    (d / "extra.safetensors").write_bytes(b"x")  # vLLM would load it too
    assert check_recorded_files(d) is not None  # a vocab folder holds unrecorded files (coverage.json)
    with pytest.raises(InputError, match=r"\['extra.safetensors'\] are not among the files .* records"):
        check_recorded_files(d, exhaustive=True)
    (d / ".sha256.json").write_text("{not json")
    with pytest.raises(InputError, match=r"\.sha256\.json: unreadable record"):
        check_recorded_files(d)


def test_after_snakemake_touches_an_output_one_consumer_hashes_it_and_the_rest_trust_it(tmp_path, monkeypatch):
    import os

    from eagle3_pipeline import io
    from eagle3_pipeline.io import checked_sha256, file_stat

    f = tmp_path / "shard.safetensors"
    f.write_bytes(b"states" * 1000)
    digest, stat = sha256_file(f), file_stat(f)
    os.utime(f)  # what Snakemake does to every output when its job ends (dag.check_and_touch_output)
    reads = []
    monkeypatch.setattr(io, "sha256_file", lambda p, *a: reads.append(p) or sha256_file(p))
    assert checked_sha256(f, digest, stat, "idx.json") == digest and len(reads) == 1  # the first consumer
    assert checked_sha256(f, digest, stat, "idx.json") == digest and len(reads) == 1  # later ones, other processes too
    assert json.loads((tmp_path / ".sha256-checked.json").read_text())["shard.safetensors"]["sha256"] == digest
    os.utime(f)  # touched again: hashed again
    assert checked_sha256(f, digest, stat, "idx.json") == digest and len(reads) == 2


def test_recorded_input_problems_names_altered_files_and_skips_unrecorded_ones(tmp_path):
    from eagle3_pipeline.io import record_files
    from eagle3_pipeline.verify import recorded_input_problems

    traces, hs = make_run(tmp_path)
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.save(vocab / "d2t.npy", np.arange(4))
    record_files(vocab)
    loose = tmp_path / "notes.jsonl"  # no record: left to its stage
    loose.write_text("{}\n")
    paths = [str(p) for p in (traces, hs, vocab / "d2t.npy", loose, tmp_path / "missing.safetensors")]
    assert recorded_input_problems(paths) == []
    traces.write_text('{"id": "a"}\n{"id": "c"}\n')
    np.save(vocab / "d2t.npy", np.arange(5))
    problems = recorded_input_problems(paths)
    assert len(problems) == 2
    assert problems[0].startswith(f"{traces}: its bytes differ from what its producer recorded in {tmp_path / 'shard-00000.summary.json'}")
    assert problems[1].startswith(f"{vocab / 'd2t.npy'}: its bytes differ from what its producer recorded")
    assert f"`snakemake --forcerun {vocab / 'd2t.npy'}`" in problems[1]  # the file, a job output; the folder is none

    # a drafter folder may hold no file its record does not list (vLLM may load any): named at the start,
    # as its evaluation job would name it; a file added beside the vocabulary's recorded files is not read
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    record_files(drafter)
    (vocab / "notes.txt").write_text("mine")
    np.save(vocab / "d2t.npy", np.arange(4))  # its recorded bytes again
    assert recorded_input_problems([str(drafter), str(vocab / "d2t.npy")]) == []
    (drafter / "extra.safetensors").write_text("x")
    (problem,) = recorded_input_problems([str(drafter)])
    assert problem.startswith(f"{drafter}: ['extra.safetensors'] are not among the files {drafter / '.sha256.json'} records")


def test_a_run_names_an_input_folder_without_its_record_on_the_console(tmp_path, capsys):
    """A drafter brought from elsewhere (Snakemake did not make it) without a .sha256.json is used
    as it is, and the run says so on the console at its start, not only in the evaluation's log;
    one Snakemake made whose record was removed is refused."""
    from eagle3_pipeline.io import FILES_RECORD, record_files

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    record_files(drafter)
    target = tmp_path / "target"  # a folder no stage checks against a record: never named
    target.mkdir()
    named = {"drafter": [str(drafter)], "target": [str(target)]}
    jobs = [{"input": [str(drafter), str(target)], "named_input": named, "output": [str(tmp_path / "eval" / "acceptance.json")]}]
    check_pending_inputs(jobs)
    assert "WARNING" not in capsys.readouterr().err
    (drafter / FILES_RECORD).unlink()
    check_pending_inputs(jobs)
    err = capsys.readouterr().err
    assert f"1 input(s) of pending jobs were not made by this workflow and have no record of their files ({FILES_RECORD})" in err
    assert str(drafter) in err and str(target) not in err
    check_pending_inputs(jobs + [{"input": [], "output": [str(drafter)]}])  # remade by a pending job: not an input
    assert "WARNING" not in capsys.readouterr().err
    check_pending_inputs(jobs, made_here=lambda path: False)  # Snakemake did not make it: brought from elsewhere
    assert "1 input(s) of pending jobs were not made by this workflow" in capsys.readouterr().err
    with pytest.raises(WorkflowError) as e:  # Snakemake made it, and its record is gone: refused
        check_pending_inputs(jobs, made_here=lambda path: True)
    assert str(e.value).startswith("1 input(s) of pending jobs were made by this workflow but have lost the record")
    assert f"`snakemake --forcerun {drafter}`" in str(e.value) and f"`snakemake --cleanup-metadata {drafter}`" in str(e.value)


def test_a_draft_vocabulary_that_lost_its_record_is_refused_when_the_workflow_made_it(tmp_path, capsys):
    """train_drafter's d2t/t2d without their folder's .sha256.json (which build_vocab_mapping
    writes): refused when Snakemake made them, as a drafter is; a token_freq file beside them,
    which no pending job names as d2t/t2d, is not named."""
    from eagle3_pipeline.io import FILES_RECORD, record_files

    vocab = tmp_path / "vocab"
    vocab.mkdir()
    for name in ("d2t", "t2d", "token_freq"):
        np.save(vocab / f"{name}.npy", np.arange(4))
    record_files(vocab, ["d2t.npy", "t2d.npy", "token_freq.npy"])
    d2t, t2d = str(vocab / "d2t.npy"), str(vocab / "t2d.npy")
    jobs = [{"input": [d2t, t2d], "named_input": {"d2t": [d2t], "t2d": [t2d]}, "output": [str(tmp_path / "drafter")]}]
    check_pending_inputs(jobs, made_here=lambda path: True)  # recorded: fine
    assert "WARNING" not in capsys.readouterr().err
    (vocab / FILES_RECORD).unlink()
    with pytest.raises(WorkflowError) as e:
        check_pending_inputs(jobs, made_here=lambda path: True)
    msg = str(e.value)
    assert msg.startswith("2 input(s) of pending jobs were made by this workflow but have lost the record of their files")
    assert f"  {d2t}: no {vocab / FILES_RECORD}; remake it with `snakemake --forcerun {d2t}`" in msg
    assert f"a file of your own there on purpose, `snakemake --cleanup-metadata {t2d}`" in msg and "token_freq" not in msg
    check_pending_inputs(jobs, made_here=lambda path: False)  # brought from elsewhere: named, used as given
    err = capsys.readouterr().err
    assert "2 input(s) of pending jobs were not made by this workflow" in err and d2t in err and t2d in err


@pytest.mark.e2e
def test_a_drafter_that_lost_its_record_is_refused_until_snakemake_forgets_making_it(e2e_run, tmp_path):
    """The finished run's drafter with its .sha256.json deleted: the evaluation's rerun is refused
    at the start, with nothing run; after `snakemake --cleanup-metadata` on it the run takes it as
    a drafter brought from elsewhere (a warning), and its evaluation starts."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from e2e_support import IN_PROCESS_ENGINES

    src, _, _ = e2e_run
    wd = tmp_path / "wd"
    shutil.copytree(src, wd, symlinks=True)
    drafter = "results/e2e/drafter"
    (wd / drafter / ".sha256.json").unlink()
    args = ("--cores", "2", "--resources", "mem_gb=100", "--forcerun", "evaluate_drafter")
    r = snakemake_cli(wd, wd / "small.yaml", *args, cwd=wd)
    assert r.returncode != 0 and "1 input(s) of pending jobs were made by this workflow" in r.stderr, r.stderr[-3000:]
    assert f"`snakemake --cleanup-metadata {drafter}`" in r.stderr and "evaluate_drafter.log" not in r.stderr
    r = snakemake_cli(wd, wd / "small.yaml", "--cleanup-metadata", drafter, cwd=wd)
    assert r.returncode == 0, r.stderr[-2000:]
    cmd = [sys.executable, "-m", "snakemake", *args, "-s", str(ROOT / "Snakefile"), "-d", str(wd), "--configfile", str(wd / "small.yaml")]
    proc = subprocess.Popen(
        cmd,
        cwd=wd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, **IN_PROCESS_ENGINES},
    )
    seen = []
    try:
        for line in proc.stderr:  # up to the evaluation's start: its run is not what this test checks
            seen.append(line)
            if line.startswith(("rule ", "localrule ")) or "Error" in line:  # the first job, or a refusal
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    err = "".join(seen)
    assert "1 input(s) of pending jobs were not made by this workflow" in err and drafter in err, err[-3000:]
    assert seen[-1].startswith(("rule evaluate_drafter", "localrule evaluate_drafter")), err[-3000:]  # not trained again


@pytest.mark.e2e
def test_a_run_whose_inputs_were_altered_stops_before_snakemake_deletes_anything(e2e_run, tmp_path):
    """A trace shard edited after its hidden states were extracted: Snakemake reruns extraction (the
    traces are newer) and would delete the shard's hidden states before extraction refused the
    traces; the run stops at its start instead, naming the file, with every output still there."""
    import shutil

    src, _, _ = e2e_run
    wd = tmp_path / "wd"
    shutil.copytree(src, wd, symlinks=True)
    res = wd / "results" / "e2e"
    traces = res / "traces" / "shard-00001.jsonl"
    traces.write_text(traces.read_text() + "\n")  # one more byte: the records themselves read the same
    kept = {p: p.stat().st_mtime_ns for p in (res / "hidden_states" / "shard-00001.safetensors", res / "vocab" / "d2t.npy")}
    r = snakemake_cli(wd, wd / "small.yaml", "--cores", "2", "--resources", "mem_gb=100", cwd=wd)
    assert r.returncode != 0
    assert "input file(s) of pending jobs differ from what their producers recorded; nothing was run or deleted" in r.stderr
    assert "results/e2e/traces/shard-00001.jsonl: its bytes differ from what its producer recorded in" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    # the command it names reruns the shard's generation and everything made from it (deleting the file would not)
    hint = "`snakemake --forcerun results/e2e/traces/shard-00001.jsonl` and the run's own options"
    assert hint in r.stderr
    r = snakemake_cli(wd, wd / "small.yaml", "-n", "--quiet", "rules", "--forcerun", "results/e2e/traces/shard-00001.jsonl", cwd=wd)
    assert r.returncode == 0, r.stderr[-2000:]
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", r.stdout + r.stderr, re.M))
    assert jobs.get("generate_traces") == "1" and jobs.get("extract_hidden_states") == "1", r.stdout + r.stderr
    assert {"build_vocab_mapping", "train_drafter", "evaluate_drafter"} <= set(jobs) and "prepare_prompts" not in jobs


def test_an_edited_prompt_shard_is_refused_at_the_start_and_by_generation(tmp_path):
    """Each prompt's id is the hash of its messages (prepare_prompts' records, here through
    build_prompt_set): a shard whose first prompt's text was changed, as a user would, is named
    by the run's start check with its line and id, and by generation before any engine."""
    from eagle3_pipeline.generation import run_generation_shard
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.prompts import build_prompt_set, edited_prompts, prompt_id
    from eagle3_pipeline.verify import recorded_input_problems

    records = build_prompt_set([{"type": "builtin_sharegpt"}], turns="first", max_prompts=3).records
    shard = tmp_path / "prompts" / "shard-00001.jsonl"
    shard.parent.mkdir()
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert all(r["id"] == prompt_id(r["messages"]) for r in records)  # the convention checked
    assert edited_prompts(shard) is None and recorded_input_problems([str(shard)], [str(shard)]) == []
    text = records[1]["messages"][0]["content"]
    shard.write_text(shard.read_text().replace(json.dumps(text), json.dumps("Z" + text[1:]), 1))
    (problem,) = recorded_input_problems([str(shard)], [str(shard)])
    assert problem.startswith(f"{shard}:2: prompt {records[1]['id']!r} is not the hash of its messages (1 such record(s))")
    assert f"--forcerun {shard}" in problem
    assert recorded_input_problems([str(shard)]) == []  # not named as a prompt shard: not read
    with pytest.raises(InputError) as e:  # before the target is looked at
        run_generation_shard(str(shard), {}, str(tmp_path / "no-target"), {}, chunk_prompts=2)
    assert str(e.value) == problem
    shard.write_text("\n" + shard.read_text())  # a blank line first: the file's own line numbers
    assert edited_prompts(shard).startswith(f"{shard}:3: prompt {records[1]['id']!r}")


def test_a_prompt_removed_from_or_repeated_in_a_shard_is_refused_at_the_start(tmp_path):
    """Removing or repeating a whole record leaves every id the hash of its messages; the prompt
    set's summary (prompts/summary.json, ``shards``: records per shard as prepare_prompts wrote
    them) shows it, at the run's start as in generation. Without that summary only ids are checked."""
    from eagle3_pipeline.io import write_json_atomic
    from eagle3_pipeline.layout import RunLayout
    from eagle3_pipeline.prompts import build_prompt_set, edited_prompts
    from eagle3_pipeline.verify import recorded_input_problems

    records = build_prompt_set([{"type": "builtin_sharegpt"}], turns="first", max_prompts=5).records
    lay = RunLayout.at(tmp_path / "run")
    shards = [Path(lay.prompt_shard("00000")), Path(lay.prompt_shard("00001"))]
    shards[0].parent.mkdir(parents=True)
    lines = [json.dumps(r) + "\n" for r in records]
    shards[0].write_text("".join(lines[:2]))
    shards[1].write_text("".join(lines[2:]))
    write_json_atomic(lay.prompt_summary(), {"kept": 5, "shards": [2, 3]})
    assert recorded_input_problems(map(str, shards), map(str, shards)) == []
    for edited in ("".join(lines[2:4]), "".join(lines[2:] + lines[3:4])):  # one removed; one repeated
        shards[1].write_text(edited)
        n = edited.count("\n")
        (problem,) = recorded_input_problems(map(str, shards), map(str, shards))
        assert problem.startswith(f"{shards[1]}: {n} records, but prepare_prompts wrote 3 ({lay.prompt_summary()})")
        assert f"--forcerun {shards[1]}" in problem and edited_prompts(shards[0]) is None
    shards[1].write_text("".join(lines[2:3] + lines[3:4] + lines[3:4]))  # one removed, another repeated in its place
    (problem,) = recorded_input_problems(map(str, shards), map(str, shards))
    assert problem.startswith(f"{shards[1]}:3: prompt {records[3]['id']!r} repeats line 2 (1 such record(s))"), problem
    Path(lay.prompt_summary()).unlink()
    assert edited_prompts(shards[1]) == problem  # a shard from elsewhere: its ids alone, each once
    shards[1].write_text("".join(lines[2:4]))
    assert edited_prompts(shards[1]) is None


def test_a_file_modified_after_the_job_that_wrote_it_is_named_with_both_times(tmp_path):
    """Snakemake records each output's modification time when its job ends (its metadata's
    ``endtime``); a file without a record of its bytes whose time has moved since, an evaluation
    question edited or a prompt record replaced by another whose id is its hash, is named. A file
    Snakemake did not make, a folder, and a file a record of bytes covers are left to their checks."""
    import os

    from eagle3_pipeline.io import record_files
    from eagle3_pipeline.prompts import build_prompt_set
    from eagle3_pipeline.verify import modified_after_written, recorded_input_problems

    questions = tmp_path / "eval" / "prompts.jsonl"
    questions.parent.mkdir()
    questions.write_text('{"id": "q1", "turns": ["Name a prime."]}\n')
    end = questions.stat().st_mtime
    made = {str(questions): ("prepare_eval_prompts", end)}
    assert modified_after_written(questions, made[str(questions)]) is None
    questions.write_text('{"id": "q1", "turns": ["Ignore that. Say hello."]}\n')
    os.utime(questions, (end + 90, end + 90))
    problem = modified_after_written(questions, made[str(questions)])
    assert problem.startswith(f"{questions}: modified at ") and "after the job that wrote it (prepare_eval_prompts) ended at" in problem
    assert f"`snakemake --forcerun {questions}`" in problem and "change what it is made from (a source file or setting" in problem
    assert "--cleanup-metadata" not in problem  # it would freeze the file against later changes of its settings
    assert modified_after_written(questions, None) is None  # not made here: used as given
    assert modified_after_written(questions, ("prepare_eval_prompts", None)) is None  # no time recorded
    assert modified_after_written(tmp_path / "eval", ("x", end)) is None  # a folder: its files move its time
    assert recorded_input_problems([str(questions)], written_at=made.get) == [problem]
    assert recorded_input_problems([str(questions)]) == []  # no metadata asked: not checked

    # a prompt record replaced by another whose id is its messages' hash: only the time shows it
    source = tmp_path / "src.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {k}"}]}) + "\n" for k in range(4)))
    *records, other = build_prompt_set([{"type": "file", "path": str(source)}]).records
    shard = tmp_path / "prompts" / "shard-00000.jsonl"
    shard.parent.mkdir()
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    made[str(shard)] = ("prepare_prompts", shard.stat().st_mtime)
    assert recorded_input_problems([str(shard)], [str(shard)], made.get) == []
    shard.write_text("".join(json.dumps(r) + "\n" for r in [*records[:2], other]))
    os.utime(shard, (end + 60, end + 60))  # edited a minute later (a file system's clock may not tick between two writes)
    (problem,) = recorded_input_problems([str(shard)], [str(shard)], made.get)
    assert problem.startswith(f"{shard}: modified at ") and "(prepare_prompts)" in problem

    # a vocabulary file touched with its bytes unchanged: its record of bytes decides, not its time;
    # a file beside it that the record does not list is checked by its time
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.save(vocab / "d2t.npy", np.arange(3))
    (vocab / "coverage.json").write_text("{}")
    record_files(vocab, ["d2t.npy"])
    d2t, coverage = vocab / "d2t.npy", vocab / "coverage.json"
    made |= {str(d2t): ("build_vocab_mapping", d2t.stat().st_mtime), str(coverage): ("build_vocab_mapping", coverage.stat().st_mtime)}
    os.utime(d2t, (end + 90, end + 90))
    os.utime(coverage, (end + 90, end + 90))
    (problem,) = recorded_input_problems([str(d2t), str(coverage)], written_at=made.get)
    assert problem.startswith(f"{coverage}: modified at ")  # d2t: its bytes are the recorded ones


@pytest.mark.e2e
def test_a_run_refuses_questions_and_prompts_edited_after_their_jobs_ended(e2e_run, tmp_path):
    """A finished run's evaluation question edited, and a prompt record replaced by another whose
    id is its messages' hash: no record of bytes covers either, and Snakemake would rerun
    generation and the evaluation on them ("Updated input files") and rewrite the manifest over the
    evidence. The run stops at its start instead, naming both from Snakemake's own record of when
    their jobs ended, with every output still there."""
    import shutil

    from eagle3_pipeline.prompts import prompt_id

    src, _, _ = e2e_run
    wd = tmp_path / "wd"
    shutil.copytree(src, wd, symlinks=True)
    res = wd / "results" / "e2e"
    questions = res / "eval" / "prompts.jsonl"
    questions.write_text(questions.read_text().replace('"turns": ["', '"turns": ["Ignore that. Say hello 100 times. ', 1))
    shard = res / "prompts" / "shard-00001.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    messages = [{"role": "user", "content": "Tell me a joke about pirates."}]
    lines[2] = json.dumps(json.loads(lines[2]) | {"id": prompt_id(messages), "messages": messages}) + "\n"
    shard.write_text("".join(lines))
    kept = {
        p: p.stat().st_mtime_ns for p in (res / "traces" / "shard-00001.jsonl", res / "eval" / "acceptance.json", res / "manifest.json")
    }
    r = snakemake_cli(wd, wd / "small.yaml", "--cores", "2", "--resources", "mem_gb=100", cwd=wd)
    assert r.returncode != 0
    assert "2 input file(s) of pending jobs differ from what their producers recorded; nothing was run or deleted" in r.stderr, r.stderr[
        -3000:
    ]
    for path, rule in (
        ("results/e2e/eval/prompts.jsonl", "prepare_eval_prompts"),
        ("results/e2e/prompts/shard-00001.jsonl", "prepare_prompts"),
    ):
        assert f"{path}: modified at " in r.stderr and f"after the job that wrote it ({rule}) ended at" in r.stderr
        assert f"`snakemake --forcerun {path}`" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in kept} == kept

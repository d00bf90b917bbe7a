"""The ``verify`` target: re-check every shard against its manifest.

Trace shards are checked against ``traces_sha256`` and ``ok`` in their
``.summary.json``; hidden-state shards against ``sha256``, ``num_samples`` and
``num_tokens`` in their ``.index.json``, and their safetensors header and offsets are
read back. A shard that is missing, truncated or altered is named with what differs.

When the run has finished, its run manifest (``results/<run>/manifest.json``,
:mod:`eagle3_pipeline.lineage`) is checked too: every artifact it lists (the drafter's
files, the vocabulary, evaluation results, plots...) and the target and prompt sources
are hashed again and compared, so a drafter replaced or a target edited after the run is
named. Each file is read once even when both checks cover it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from .generation import traces_summary_path
from .io import InputError, read_record, remake_hint
from .lineage import Hasher, check_manifest


def _check_trace_shard(path: Path, hasher: Hasher) -> list[str]:
    summary = traces_summary_path(path)
    if not path.is_file():
        return [f"{path}: missing"]
    if not summary.is_file():
        return [f"{summary}: manifest missing"]
    try:
        m = read_record(summary, path)
    except InputError as e:  # not JSON, or not an object
        return [str(e)]
    problems = []
    digest = hasher.file(path)
    if digest != m.get("traces_sha256"):
        problems.append(f"{path}: sha256 {digest[:12]}… does not match the manifest's {str(m.get('traces_sha256'))[:12]}…")
    with open(path, "rb") as f:
        n = sum(1 for line in f if line.strip())
    if n != m.get("ok"):
        problems.append(f"{path}: {n} records, the manifest says {m.get('ok')}")
    return problems


def _check_hidden_shard(path: Path, hasher: Hasher) -> list[str]:
    from .shards import ShardReader, shard_index_path

    index = shard_index_path(path)
    if not path.is_file():
        return [f"{path}: missing"]
    if not index.is_file():
        return [f"{index}: manifest missing"]
    try:
        m = read_record(index, path)
    except InputError as e:
        return [str(e)]
    problems = []
    size = os.path.getsize(path)
    if size != m.get("bytes"):
        how = "truncated?" if isinstance(m.get("bytes"), int) and size < m["bytes"] else "replaced?"
        problems.append(f"{path}: {size} bytes, the manifest says {m.get('bytes')} ({how})")
    digest = hasher.file(path)
    if digest != m.get("sha256"):
        problems.append(f"{path}: sha256 {digest[:12]}… does not match the manifest's {str(m.get('sha256'))[:12]}…")
    try:
        r = ShardReader(path)
        if len(r) != m["num_samples"] or int(r.offsets[-1]) != m["num_tokens"]:
            problems.append(
                f"{path}: {len(r)} samples / {int(r.offsets[-1])} tokens, the manifest says {m['num_samples']} / {m['num_tokens']}"
            )
    except Exception as e:  # a damaged header raises from safetensors
        problems.append(f"{path}: unreadable ({type(e).__name__}: {e})")
    return problems


#: How far a file's modification time may be from the one Snakemake recorded when the job that
#: wrote it ended (seconds): the two are one ``stat`` of the same file, so equal where it is unchanged.
MTIME_TOLERANCE_S = 1e-3


def modified_after_written(path: str | os.PathLike, written: tuple[str, float] | None) -> str | None:
    """What shows that a file no record of bytes covers was changed after the job that wrote it
    ended, or None: Snakemake records, when a job ends, each output's modification time
    (``endtime`` in its metadata, after its own touch of the outputs; ``snakemake --touch`` records
    anew), so a file modified since (edited, replaced, appended to, touched by hand) no longer has
    it. Snakemake would rerun the stages that read it ("Updated input files") on bytes their
    producer did not write; this names it instead. It does not offer ``snakemake
    --cleanup-metadata``: a file Snakemake forgot making is never remade when the settings it is
    made from change, and the run manifest would name a producer that did not write it.

    Args:
        path: a regular file (a folder is left alone: files inside move its time).
        written: ``(rule, endtime)`` of the job Snakemake recorded as its maker, endtime in seconds
            since the epoch; None when Snakemake did not make it (brought from elsewhere, or its
            metadata removed with ``snakemake --cleanup-metadata``): not checked.

    Returns:
        one line naming the file, both times (UTC), the rule and what to do; None when unchanged.
    """
    from datetime import UTC, datetime

    p = Path(path)
    if written is None or written[1] is None or not p.is_file():
        return None
    rule, end = written
    mtime = p.stat().st_mtime
    if abs(mtime - end) <= MTIME_TOLERANCE_S:
        return None

    def utc(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    return (
        f"{p}: modified at {utc(mtime)}, after the job that wrote it ({rule}) ended at {utc(end)}, and no record of its "
        f"bytes covers it, so the stage would read what its producer may not have written: {remake_hint(p)}. To make it "
        "with other content, change what it is made from (a source file or setting in the config) instead, and the run "
        "remakes it"
    )


def recorded_input_problems(
    paths: Iterable[str | os.PathLike],
    prompt_shards: Iterable[str | os.PathLike] = (),
    written_at: Callable[[str], tuple[str, float] | None] | None = None,
) -> list[str]:
    """What is wrong with files stages are about to read, each checked against its producer's
    record as the stage that reads it checks it, so a run can refuse at its start, before
    Snakemake deletes the outputs of the jobs it reruns.

    Checked: a trace shard with its ``.summary.json`` (:func:`eagle3_pipeline.generation.recorded_traces_sha256`),
    a hidden-state shard with its ``.index.json`` (:func:`eagle3_pipeline.shards.recorded_shard_sha256`), and a directory with a record of its
    files, or a file in one (:func:`eagle3_pipeline.io.check_recorded_files`: the vocabulary, a
    drafter). Each by :func:`eagle3_pipeline.io.checked_sha256`: a file unwritten since it was last
    hashed is not read again. Files without a record, and missing files, are left to their stage.
    The prompt shards among ``paths`` (``prompt_shards``: generate_traces' ``prompts`` inputs)
    are checked as generation checks them: each record's id is its messages' hash
    (:func:`eagle3_pipeline.prompts.edited_prompts`). A file no record of bytes covers (the prompt
    shards too, the evaluation questions, JSON records the summary reads) is checked against
    the time Snakemake recorded when its job ended (``written_at``, :func:`modified_after_written`).

    Args:
        written_at: ``path -> (rule, endtime)`` of the job Snakemake recorded as the file's maker,
            None where it made none (:func:`eagle3_pipeline.snakemake_adapter.snakemake_makers`);
            None: that check is not made.

    Returns:
        one line per problem (the stage's own error message, naming the file, both hashes and what
        to do); empty when every recorded file is as its producer wrote it.
    """
    from .generation import recorded_traces_sha256
    from .io import FILES_RECORD, InputError, check_recorded_files
    from .layout import index_beside, summary_beside
    from .prompts import edited_prompts
    from .shards import recorded_shard_sha256

    problems, records, prompts = [], {}, {Path(p) for p in prompt_shards}
    for p in map(Path, paths):
        covered = False  # by a record of its bytes
        try:
            if p in prompts:
                if p.is_file() and (edited := edited_prompts(p)) is not None:
                    problems.append(edited)
                    continue
            elif p.is_dir() or (p.is_file() and (p.parent / FILES_RECORD).is_file()):
                d = p if p.is_dir() else p.parent
                if d not in records and (d / FILES_RECORD).is_file():
                    records[d] = {}  # checked once, its problem named once
                    # the drafter, whose every file vLLM may load (exhaustive, as evaluation checks it); the vocabulary's files each
                    records[d] = check_recorded_files(d, exhaustive=p.is_dir(), directory_output=p.is_dir()) or {}
                covered = p.is_dir() or p.name in records.get(d, {})
            elif p.is_file() and p.suffix == ".jsonl" and summary_beside(p).is_file():
                recorded_traces_sha256(p)
                covered = True
            elif p.is_file() and p.suffix == ".safetensors" and index_beside(p).is_file():
                recorded_shard_sha256(p)
                covered = True
        except InputError as e:
            problems.append(str(e))
            continue
        if not covered and written_at is not None and (changed := modified_after_written(p, written_at(str(p)))) is not None:
            problems.append(changed)
    return problems


def verify_run(trace_shards: list[str], hidden_shards: list[str], manifest: str | None = None) -> dict:
    """Check all shards, and the run manifest if ``manifest`` is given and exists.

    Returns:
        ``{"checked": n shards, "traces": n trace shards, "hidden_states": n hidden-state shards,
        "manifest": "checked" | "absent" | None, "manifest_entries": entries the manifest lists
        (artifacts + external; 0 unless checked), "problems": [...]}`` (empty problems = all
        good). An absent manifest is not a problem: the run may not have finished. A run with
        none of its shards and no manifest (not started here, or another run's config meant) is
        one problem saying so (``"no_run": True``), not each shard missing.
    """
    shards = [*trace_shards, *hidden_shards]
    if not any(Path(p).exists() for p in shards) and (manifest is None or not Path(manifest).exists()):
        run_dir = Path(shards[0]).parents[1] if shards else None
        return {
            "checked": 0,
            "traces": 0,
            "hidden_states": 0,
            "manifest": None,
            "manifest_entries": 0,
            "problems": [
                f"nothing to verify: no shard of this run and no run manifest under {run_dir or 'the run directory'} (the run has "
                "not started in this directory); for another run, give its config: `snakemake verify --configfile <its config>`"
            ],
            "no_run": True,
        }
    hasher = Hasher()
    problems: list[str] = []
    for p in trace_shards:
        problems += _check_trace_shard(Path(p), hasher)
    for p in hidden_shards:
        problems += _check_hidden_shard(Path(p), hasher)
    state, entries = None, 0
    if manifest is not None:
        state = "checked" if Path(manifest).is_file() else "absent"
        if state == "checked":
            try:
                m = read_record(manifest)
                entries = len(m["artifacts"]) + len(m["external"])
            except (InputError, KeyError, TypeError) as e:  # damaged: named, the shards still reported
                problems.append(
                    str(e) if isinstance(e, InputError) else f"{manifest}: not a run manifest (no {e}); {remake_hint(manifest)}"
                )
            else:
                problems += check_manifest(manifest, hasher)
    return {
        "checked": len(trace_shards) + len(hidden_shards),
        "traces": len(trace_shards),
        "hidden_states": len(hidden_shards),
        "manifest": state,
        "manifest_entries": entries,
        "problems": problems,
    }


def summary_lines(res: dict, manifest: str | None = None) -> list[str]:
    """What :func:`verify_run` checked and found, in a few lines for the console and the log:
    the shards checked and ``ok`` (or the number of problems), then the run manifest's state."""
    shards = f"{res['traces']} trace and {res['hidden_states']} hidden-state shards (record and token counts, SHA-256)"
    if res.get("no_run"):
        return [f"verify FAILED: {res['problems'][0]}"]
    if res["problems"]:
        lines = [
            f"verify FAILED: {len(res['problems'])} problem(s) in {shards}"
            + (" and the run manifest" if res["manifest"] == "checked" else "")
        ]
        hint = f"Each file listed: {remake_hint('<file>')}; for a file inside a directory output (the drafter's), name the directory"
        return lines + [f"  {p}" for p in res["problems"]] + [hint]
    lines = [f"verify ok: all {res['checked']} shards match their manifests: {shards}"]
    if res["manifest"] == "checked":
        lines.append(f"verify ok: every file in {manifest} matches ({res['manifest_entries']} entries re-hashed)")
    elif res["manifest"] == "absent":
        lines.append(f"verify: no run manifest {manifest} yet (written at the end of a run); shards only")
    return lines

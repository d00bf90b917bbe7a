"""Config validation against ``config/schema.yaml``: defaults filled, unknown keys rejected."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from pathlib import Path

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"
#: The shipped config (the Snakefile's ``configfile:``), whose key order :func:`canonical_order` keeps.
DEFAULT_CONFIG_PATH = SCHEMA_PATH.with_name("config.yaml")


class ConfigError(ValueError):
    """The configuration does not match the schema; the message lists every problem."""


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def load_schema(path: str | os.PathLike = SCHEMA_PATH) -> dict:
    """The JSON schema at ``path`` (config/schema.yaml by default) as a dict the caller may change.

    Parsed once per file version (path, size, mtime) with libyaml's safe loader where PyYAML has
    it: the workflow reads the schema several times while Snakemake parses the rules.
    """
    return copy.deepcopy(_parsed_yaml(str(path), *_stat(path)))


def _stat(path: str | os.PathLike) -> tuple[int, int]:
    """(size, mtime_ns) of ``path``: the version :func:`_parsed_yaml` caches a file's parse by."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


@functools.cache
def _parsed_yaml(path: str, _size: int, _mtime_ns: int) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def check_against_target(
    config: dict, num_hidden_layers: int, vocab_size: int, model_type: str | None = None, context: int | None = None
) -> None:
    """Check the settings that depend on the target's shape, before any job runs.

    Args:
        config: a validated config.
        num_hidden_layers, vocab_size: the target's shape.
        model_type: the target language model's ``model_type`` (None: not known), for the aux
            layer ids vLLM cannot capture for that family (:func:`eagle3_pipeline.conventions.vllm_aux_id_problem`).
        context: the target's context length in tokens where known before any job
            (:func:`eagle3_pipeline.target_model.configured_target_context`), else None.

    Raises:
        ConfigError: ``max_seq_len`` exceeds ``context``, ``vocab.draft_vocab_size`` exceeds the target vocabulary,
            ``extraction.aux_layer_ids`` are out of range for the target's layers or not
            ascending, ``training.aux_layer_ids`` are not among them, or vLLM cannot capture
            the ids for this family (extraction's with the ``vllm`` backend, the drafter's always:
            evaluation drafts in vLLM).
    """
    from .conventions import drafter_aux_columns, resolve_layer_ids, vllm_aux_id_problem

    problems = []
    if context is not None and config["max_seq_len"] > context:
        problems.append(
            f"  max_seq_len: {config['max_seq_len']} exceeds the target's context length ({context} tokens); set it to {context} or less"
        )
    n = config["vocab"]["draft_vocab_size"]
    if n > vocab_size:
        problems.append(f"  vocab.draft_vocab_size: {n} is larger than the target vocabulary ({vocab_size} tokens)")
    try:
        stored, _ = resolve_layer_ids(config["extraction"]["aux_layer_ids"], num_hidden_layers)
    except ValueError as e:
        problems.append(f"  extraction.aux_layer_ids: {e}")
    else:
        if config["extraction"]["backend"] == "vllm" and (why := vllm_aux_id_problem(model_type, stored)):
            problems.append(f"  extraction.aux_layer_ids: {why} (or extraction.backend: hf, and training.aux_layer_ids without 0)")
        try:
            drafter, _ = drafter_aux_columns(config["training"]["aux_layer_ids"], stored)
        except ValueError as e:
            problems.append(f"  training.aux_layer_ids: {e}")
        else:
            if why := vllm_aux_id_problem(model_type, drafter):
                problems.append(f"  training.aux_layer_ids: the drafter's {why}: vLLM could not evaluate or serve it")
    if problems:
        raise ConfigError("invalid configuration for this target:\n" + "\n".join(problems))


def check_run_against_target(
    config: dict,
    variants: dict[str, dict],
    num_hidden_layers: int,
    vocab_size: int,
    model_type: str | None = None,
    context: int | None = None,
) -> None:
    """:func:`check_against_target` for the run's settings and each sweep variant's, before any job runs.

    Args:
        config: the run's validated config.
        variants: each variant's full config (:func:`eagle3_pipeline.sweep.variant_configs`).
        num_hidden_layers, vocab_size: the target's shape.
        model_type, context: as for :func:`check_against_target`.

    Raises:
        ConfigError: the first settings that do not fit the target, a variant's prefixed with
            ``sweep.variants.<name>:``.
    """
    check_against_target(config, num_hidden_layers, vocab_size, model_type, context)
    for name, cfg in variants.items():
        try:
            check_against_target(cfg, num_hidden_layers, vocab_size, model_type, context)
        except ConfigError as e:
            raise ConfigError(f"sweep.variants.{name}: {e}") from None


def num_speculative_tokens(config: dict) -> int:
    """The draft tokens per step evaluation asks vLLM for (k): ``evaluation.num_speculative_tokens``,
    or the drafter's ``training.ttt_steps`` when null."""
    k = config["evaluation"]["num_speculative_tokens"]
    return k if k is not None else config["training"]["ttt_steps"]


def evaluation_vllm(config: dict, vllm_params: dict) -> dict:
    """The evaluation engine's settings: ``vllm_params`` (the run's ``vllm:`` params, :func:`job_settings`)
    with ``config``'s ``evaluation.enforce_eager`` where set."""
    eager = config["evaluation"]["enforce_eager"]
    return vllm_params | ({} if eager is None else {"enforce_eager": eager})


def coerce_cli_strings(cfg: dict, schema: dict) -> None:
    """Turn strings into the schema's non-string types, in place (``"2"`` → 2, ``"false"`` → False).

    Snakemake reads a mapping given on the command line or in a profile's ``config:``
    (``--config "vllm={data_parallel_size: 2}"``) with YAML's base loader, so every nested
    scalar arrives as a string, list items too (``extraction={aux_layer_ids: [1, 15, 27]}``). A
    string is parsed as YAML only where the schema does not allow a string there; what does not
    parse to an allowed type is left for validation to report.
    """
    props = schema.get("properties", {})
    for key, value in list(cfg.items()):
        sub = props.get(key)
        if isinstance(sub, dict):
            cfg[key] = _coerced(value, sub)


def _coerced(value, sub: dict):
    """``value`` with its strings turned into ``sub``'s non-string types (:func:`coerce_cli_strings`)."""
    if isinstance(value, dict):
        coerce_cli_strings(value, sub)
        return value
    if isinstance(value, list) and isinstance(sub.get("items"), dict):
        return [_coerced(v, sub["items"]) for v in value]
    types = sub.get("type", [])
    types = [types] if isinstance(types, str) else types
    if not (isinstance(value, str) and types and "string" not in types):
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    if isinstance(parsed, str) and "number" in types:  # YAML 1.1 reads "1e-4" as a string
        with contextlib.suppress(ValueError):
            parsed = float(parsed)
    py = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None), "array": list, "object": dict}
    if any(isinstance(parsed, py[t]) and not (t in ("integer", "number") and isinstance(parsed, bool)) for t in types if t in py):
        return _coerced(parsed, sub) if isinstance(parsed, list | dict) else parsed
    return value


@functools.cache
def runtime_keys(section: str) -> frozenset[str]:
    """The keys of a config section marked ``x-result: false`` in config/schema.yaml: settings
    that change how work is split, resumed or spread over processes, never what a job writes."""
    props = load_schema()["properties"][section].get("properties", {})
    return frozenset(k for k, v in props.items() if v.get("x-result") is False)


#: Extraction settings that only the ``hf`` backend reads (transformers' batches and device):
#: with the ``vllm`` backend they change nothing it writes.
HF_ONLY_EXTRACTION_KEYS = ("batch_tokens", "device")


def extraction_result_settings(x: dict) -> dict:
    """The extraction settings that change what a job writes, from ``x`` (the ``extraction``
    section, or the job's settings with the engine's under ``engine``): all but the runtime
    settings (:func:`runtime_keys` of ``extraction`` and ``vllm``, which a job's settings may
    hold), and, with the vllm backend, but :data:`HF_ONLY_EXTRACTION_KEYS`. The rule's params
    and a resume's fingerprint (:func:`eagle3_pipeline.hidden_states.extraction_fingerprint`)."""
    drop = runtime_keys("extraction") | runtime_keys("vllm") | (set(HF_ONLY_EXTRACTION_KEYS) if x["backend"] == "vllm" else set())
    return {k: v for k, v in x.items() if k not in drop}


def job_settings(config: dict) -> dict:
    """What the rules give each stage's jobs, from a validated config: the GPUs each full-model
    job uses (its ``gpu`` resource; ``--gpus`` on SLURM), training's process count, and the
    params of generation, extraction and the vLLM engine.

    Fills ``extraction.data_parallel_size`` and ``gpus_per_replica`` in ``config`` where null
    (vLLM's data-parallel size, one engine's GPUs). Params are the result settings alone
    (:func:`result_settings`): changing the others reruns nothing, and the scripts read them
    from the config; tensor/pipeline parallel sizes are params (they change numerics). With the
    vllm extraction backend, extraction's params hold the engine's and not transformers-only
    settings. ``vllm.replicas_per_gpu`` engines share each GPU.

    Returns:
        ``{"generation_gpus", "extraction_gpus", "evaluation_gpus", "train_processes",
        "vllm_params", "generation_params", "extraction_params"}``.

    Raises:
        ConfigError: ``extraction.gpus_per_replica`` is not one engine's GPUs with the vllm backend.
    """
    from .parallel import replica_gpus

    v, x = config["vllm"], config["extraction"]
    engine_gpus = v["tensor_parallel_size"] * v["pipeline_parallel_size"]
    if x["data_parallel_size"] is None:
        x["data_parallel_size"] = v["data_parallel_size"]
    if x["gpus_per_replica"] is None:
        x["gpus_per_replica"] = engine_gpus
    override = config["resources"]["full_model_gpus"]
    x_per_gpu = v["replicas_per_gpu"] if x["backend"] == "vllm" else 1
    out = {
        "generation_gpus": override if override is not None else replica_gpus(v["data_parallel_size"], engine_gpus, v["replicas_per_gpu"]),
        "extraction_gpus": override if override is not None else replica_gpus(x["data_parallel_size"], x["gpus_per_replica"], x_per_gpu),
        "evaluation_gpus": override if override is not None else engine_gpus,
        "train_processes": max(1, config["resources"]["train_gpus"]),
        "vllm_params": result_settings(config, "vllm"),
        "generation_params": result_settings(config, "generation"),
        "extraction_params": extraction_result_settings(config["extraction"]),
    }
    if x["backend"] == "vllm":
        # a vLLM replica is one engine: its GPUs are the engine's tensor x pipeline parallel size
        if x["gpus_per_replica"] != engine_gpus:
            raise ConfigError(
                f"extraction.gpus_per_replica={x['gpus_per_replica']} but the vllm backend's replica is one engine "
                f"of vllm.tensor_parallel_size x pipeline_parallel_size = {engine_gpus} GPUs; set it to {engine_gpus} or null"
            )
        out["extraction_params"]["engine"] = out["vllm_params"]
    return out


def result_settings(cfg: dict, section: str) -> dict:
    """``cfg[section]`` without its runtime settings (:func:`runtime_keys`): a rule's params, a
    resume fingerprint or a sweep's comparison, so that changing those settings reruns nothing."""
    return {k: v for k, v in cfg[section].items() if k not in runtime_keys(section)}


def runtime_settings(cfg: dict, section: str) -> dict:
    """``cfg[section]``'s runtime settings (:func:`runtime_keys`), which scripts read from the config."""
    return {k: v for k, v in cfg[section].items() if k in runtime_keys(section)}


def _did_you_mean(error: jsonschema.ValidationError) -> str:
    """For an unknown key, the known key of that section it is closest to (a typo), if any."""
    import difflib

    if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
        return ""
    known = list(error.schema.get("properties", {}))
    hints = [
        f"{close[0]!r} for {key!r}"
        for key in error.instance
        if key not in known and (close := difflib.get_close_matches(str(key), known, n=1, cutoff=0.6))
    ]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


#: ``vllm.LLM`` arguments the workflow sets itself (:func:`eagle3_pipeline.engine.build_llm` and the
#: stages' overrides), each with the setting it comes from: ``vllm.extra_engine_args`` may not
#: set them, where it would silently override the setting (an ``extra_engine_args`` of
#: ``max_model_len: 99`` ran engines shorter than the ``max_seq_len`` the stages plan for).
ENGINE_ARGS_FROM_SETTINGS = {
    "model": "target.path",
    "trust_remote_code": "target.trust_remote_code",
    "seed": "seed",
    "max_model_len": "max_seq_len",
    "tensor_parallel_size": "vllm.tensor_parallel_size",
    "pipeline_parallel_size": "vllm.pipeline_parallel_size",
    "enforce_eager": "vllm.enforce_eager",
    "enable_prefix_caching": "vllm.enable_prefix_caching",
    "dtype": "vllm.dtype",
    "gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "max_num_seqs": "vllm.max_num_seqs",
    "speculative_config": "evaluation (the drafter, num_speculative_tokens) and extraction (its hidden-state layers)",
    "kv_transfer_config": "extraction's vllm backend (its hidden-state writer)",
}


def validate_config(config: dict, schema_path: str | os.PathLike = SCHEMA_PATH) -> dict:
    """Return a copy of ``config`` with defaults filled in, after validating it.

    Strings where the schema wants another type are parsed first (:func:`coerce_cli_strings`).

    Raises:
        ConfigError: listing each violation as ``<key path>: <message>``, e.g.
            ``training.lrr: Additional properties are not allowed ('lrr' was unexpected) (did you
            mean 'lr' for 'lrr'?)``,
            or ``vllm.replicas_per_gpu`` > 1 with a multi-GPU engine, or
            ``generation.answers_per_prompt`` > 1 with greedy decoding (temperature 0),
            ``prompts.num_shards`` > ``prompts.max_prompts``,
            ``generation.min_completion_tokens`` or ``evaluation.max_tokens`` >= ``max_seq_len``, or a
            ``vllm.extra_engine_args`` key the workflow sets from a setting
            (:data:`ENGINE_ARGS_FROM_SETTINGS`).

    Normalized: ``evaluation.speedup.concurrency`` ascending; every mapping's keys in one order
    whatever order the config files wrote them in (:func:`canonical_order`).
    """
    schema = load_schema(schema_path)
    cfg = copy.deepcopy(config) if config else {}
    coerce_cli_strings(cfg, schema)
    validator = _with_defaults(jsonschema.Draft7Validator)(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            where = ".".join(str(p) for p in e.absolute_path) or "<top level>"
            lines.append(f"  {where}: {e.message}{_did_you_mean(e)}")
        raise ConfigError("invalid configuration (see config/schema.yaml):\n" + "\n".join(lines))
    # measured in ascending order whatever the order given: an order is not a setting of its own
    # (a sweep variant that only reorders them changes nothing)
    speed = cfg["evaluation"]["speedup"]
    speed["concurrency"] = sorted(speed["concurrency"])
    pr = cfg["prompts"]
    if pr["max_prompts"] is not None and pr["num_shards"] > pr["max_prompts"]:
        raise ConfigError(
            f"invalid configuration: prompts.num_shards {pr['num_shards']} is more than prompts.max_prompts "
            f"{pr['max_prompts']}: at most {pr['max_prompts']} prompts cannot fill {pr['num_shards']} shards (each shard "
            "is a generation and an extraction job); lower prompts.num_shards or raise prompts.max_prompts"
        )
    g = cfg["generation"]
    if g["min_completion_tokens"] >= cfg["max_seq_len"]:
        raise ConfigError(
            f"invalid configuration: generation.min_completion_tokens {g['min_completion_tokens']} leaves no room for a "
            f"prompt within max_seq_len {cfg['max_seq_len']} (every prompt would be rejected as prompt_too_long); "
            "lower it or raise max_seq_len"
        )
    if cfg["evaluation"]["max_tokens"] >= cfg["max_seq_len"]:
        raise ConfigError(
            f"invalid configuration: evaluation.max_tokens {cfg['evaluation']['max_tokens']} leaves no room for a prompt "
            f"within max_seq_len {cfg['max_seq_len']} (evaluation would find no prompt that fits, after every other stage); "
            "lower it or raise max_seq_len"
        )
    if g["answers_per_prompt"] > 1 and g["temperature"] == 0:
        raise ConfigError(
            f"invalid configuration: generation.answers_per_prompt {g['answers_per_prompt']} with generation.temperature 0 "
            "gives the same greedy answer every time; set temperature > 0 (e.g. 0.7, with top_p) or answers_per_prompt to 1"
        )
    v = cfg["vllm"]
    if taken := [k for k in v["extra_engine_args"] if k in ENGINE_ARGS_FROM_SETTINGS]:
        raise ConfigError(
            "invalid configuration: "
            + "; ".join(f"vllm.extra_engine_args.{k} is set by the workflow from {ENGINE_ARGS_FROM_SETTINGS[k]}" for k in taken)
            + f": set {'that setting' if len(taken) == 1 else 'those settings'} instead (config/README.md)"
        )
    if v["replicas_per_gpu"] > 1 and v["tensor_parallel_size"] * v["pipeline_parallel_size"] > 1:
        raise ConfigError(
            f"invalid configuration: vllm.replicas_per_gpu {v['replicas_per_gpu']} shares a GPU between engines, "
            f"but one engine spans tensor_parallel_size x pipeline_parallel_size = "
            f"{v['tensor_parallel_size'] * v['pipeline_parallel_size']} GPUs; set replicas_per_gpu to 1"
        )
    return canonical_order(cfg, schema, _parsed_yaml(str(DEFAULT_CONFIG_PATH), *_stat(DEFAULT_CONFIG_PATH)))


def canonical_order(value, schema: dict, shipped: dict | None = None):
    """``value`` (a validated config or part of it) with every mapping's keys in one order: first
    the keys ``shipped`` (the shipped config/config.yaml, or its part at this place) lists, in its
    order, then the others the schema lists, in the schema's order, then keys the schema does not
    list (the free mapping ``vllm.extra_engine_args``) sorted; list items in their order, each
    ordered by the schema's ``items``. The entries of ``sweep.variants`` keep the order they were
    written in (the order runs and reports list them), each variant's own keys ordered.

    Snakemake compares a job's params with those its outputs were made with by their ``repr``,
    in which a dict's key order shows: the same settings written in another order (a prompt
    source ``{path: p, type: file}``, a default written out in ``training:``) would rerun every
    job that takes them. The shipped config's order comes first because it is the order
    Snakemake's merge of a user's config over it, and then the schema's defaults, gave before:
    runs made that way keep their params.
    """
    if isinstance(value, list):
        return [canonical_order(v, schema.get("items") or {}) for v in value]
    if not isinstance(value, dict):
        return value
    shipped = shipped if isinstance(shipped, dict) else {}
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    extra = extra if isinstance(extra, dict) else {}
    keys = list(value)  # a mapping of user-named entries, each with one schema (sweep.variants)
    if props or not extra:
        first = [k for k in shipped if k in value]
        keys = first + [k for k in props if k in value and k not in shipped]
        keys += sorted((k for k in value if k not in props and k not in shipped), key=str)
    return {k: canonical_order(value[k], props.get(k, extra), shipped.get(k)) for k in keys}


def _markdown_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def schema_reference(schema: dict | None = None) -> str:
    """config/README.md: every key of ``config/schema.yaml`` (default: the project's) as Markdown.

    One table per top-level section, one row per key (nested objects flattened to
    ``section.key.sub``, an array's object items to ``section.key[].sub``): type, default (JSON;
    blank where the schema sets none), whether it changes results (``x-result``), and
    the schema's description. tests/test_config.py keeps config/README.md equal to this;
    ``make config-docs`` rewrites it.
    """
    import json

    schema = schema or load_schema()
    out = [
        "# Configuration keys",
        "",
        "Generated from `config/schema.yaml` by `make config-docs` (a test keeps the two in sync): edit the",
        "schema's descriptions, not this file. " + _markdown_cell(schema.get("description", "")),
        "",
    ]
    header = ["| key | type | default | changes results | description |", "|---|---|---|---|---|"]

    def rows(props: dict, prefix: str) -> list[str]:
        lines = []
        for name, sub in props.items():
            key = f"{prefix}{name}"
            kind = sub.get("type", "enum" if "enum" in sub else "")
            kind = " or ".join(kind) if isinstance(kind, list) else kind
            if "enum" in sub:
                kind += ": " + ", ".join(json.dumps(v) for v in sub["enum"])
            default = f"`{_markdown_cell(json.dumps(sub['default']))}`" if "default" in sub else ""
            result = "no" if sub.get("x-result") is False else "yes"
            items = sub.get("items", {})
            if sub.get("type") == "object" and "properties" in sub:
                # an object's own default ({} = each key's) only when it names keys
                default = default if sub.get("default") else ""
                lines.append(f"| `{key}` | object | {default} | {result} | {_markdown_cell(sub.get('description', ''))} |")
                lines += rows(sub["properties"], key + ".")
            elif sub.get("type") == "array" and "properties" in items:
                lines.append(f"| `{key}` | array of objects | {default} | {result} | {_markdown_cell(sub.get('description', ''))} |")
                lines += rows(items["properties"], key + "[].")
            else:
                lines.append(f"| `{key}` | {_markdown_cell(kind)} | {default} | {result} | {_markdown_cell(sub.get('description', ''))} |")
        return lines

    sections = {k: v for k, v in schema["properties"].items() if "properties" in v}
    scalars = {k: v for k, v in schema["properties"].items() if k not in sections}
    out += ["## Top-level keys", "", *header, *rows(scalars, ""), ""]
    for section, sub in sections.items():
        out += [f"## `{section}`", ""]
        if sub.get("description"):
            out += [_markdown_cell(sub["description"]), ""]
        out += [*header, *rows(sub["properties"], section + "."), ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(schema_reference(), end="")

from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config import ConfigError, check_against_target, validate_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_filled():
    cfg = validate_config({})
    assert cfg["vocab"]["draft_vocab_size"] == 8192
    assert cfg["prompts"]["sources"] == [{"type": "builtin_sharegpt"}]
    assert cfg["evaluation"]["prompts"] == {"type": "builtin_mtbench"}
    assert cfg["training"]["ttt_steps"] == 3


def test_defaults_are_not_shared_between_calls():
    a = validate_config({})
    a["prompts"]["sources"].append({"type": "file", "path": "x.jsonl"})
    assert validate_config({})["prompts"]["sources"] == [{"type": "builtin_sharegpt"}]


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"training: Additional properties are not allowed \('lrr' was unexpected\)"):
        validate_config({"training": {"lrr": 0.1}})


def test_a_misspelt_key_is_named_with_the_key_it_is_closest_to():
    with pytest.raises(ConfigError) as e:
        validate_config({"vocab": {"draft_vocab_sise": 4096}, "traning": {}, "training": {"lrr": 1e-4, "qqqqzz": 1}})
    lines = str(e.value).splitlines()[1:]
    assert lines == [
        "  <top level>: Additional properties are not allowed ('traning' was unexpected) (did you mean 'training' for 'traning'?)",
        "  training: Additional properties are not allowed ('lrr', 'qqqqzz' were unexpected) (did you mean 'lr' for 'lrr'?)",
        "  vocab: Additional properties are not allowed ('draft_vocab_sise' was unexpected) (did you mean 'draft_vocab_size' for "
        "'draft_vocab_sise'?)",
    ]


def test_out_of_range_value_is_an_error():
    with pytest.raises(ConfigError, match="vocab.draft_vocab_size"):
        validate_config({"vocab": {"draft_vocab_size": 0}})


def test_file_source_needs_a_path():
    with pytest.raises(ConfigError, match="'path' is a required property"):
        validate_config({"prompts": {"sources": [{"type": "file"}]}})


@pytest.mark.parametrize(
    "path", ["config/config.yaml", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "config" / "examples").glob("*.yaml"))]
)
def test_shipped_configs_validate(path):
    validate_config(yaml.safe_load((ROOT / path).read_text()))


def test_target_dependent_settings_are_checked_before_any_job():
    cfg = validate_config({"vocab": {"draft_vocab_size": 60000}, "extraction": {"aux_layer_ids": [2, 40]}})
    with pytest.raises(ConfigError) as e:
        check_against_target(cfg, 30, 49152)
    msg = str(e.value)
    assert "vocab.draft_vocab_size: 60000 is larger than the target vocabulary (49152 tokens)" in msg
    assert "extraction.aux_layer_ids: aux layer ids [40] out of range" in msg
    check_against_target(validate_config({}), 30, 49152)  # the default fits the embedded target
    # the embedded target's context is known before it exists; a user's target's is vLLM's to derive at the start
    from eagle3_pipeline.target_model import BUILTIN_TARGET, configured_target_context

    long = validate_config({"max_seq_len": 8193})
    with pytest.raises(ConfigError, match=r"max_seq_len: 8193 exceeds the target's context length \(8192 tokens\)"):
        check_against_target(long, 30, 49152, context=configured_target_context(BUILTIN_TARGET))
    check_against_target(long, 30, 49152, context=configured_target_context("/models/mine"))


def test_nested_command_line_strings_take_the_schema_types():
    """Snakemake hands nested --config / profile config: values over as strings."""
    from eagle3_pipeline.config import validate_config

    cfg = validate_config(
        {
            "run": "007",
            "resources": {"host_lock": "False", "train_gpus": "2"},
            "vllm": {"data_parallel_size": "2", "gpu_memory_utilization": "0.8"},
            "training": {"max_steps": "null", "lr": "1e-4"},
            "extraction": {"aux_layer_ids": "[1, 2]"},
        }
    )
    assert cfg["run"] == "007"  # a string where the schema wants one stays a string
    assert cfg["resources"]["host_lock"] is False and cfg["resources"]["train_gpus"] == 2
    assert cfg["vllm"]["data_parallel_size"] == 2 and cfg["vllm"]["gpu_memory_utilization"] == 0.8
    assert cfg["training"]["max_steps"] is None and cfg["training"]["lr"] == 1e-4
    assert cfg["extraction"]["aux_layer_ids"] == [1, 2]


def test_a_string_that_is_not_the_type_is_still_an_error():
    import pytest

    from eagle3_pipeline.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"vllm.data_parallel_size: 'two' is not of type 'integer'"):
        validate_config({"vllm": {"data_parallel_size": "two"}})


@pytest.mark.parametrize("name", [".", "..", "-x", "a/b", ""])
def test_a_run_name_is_a_folder_name(name):
    from eagle3_pipeline.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"run: .* does not match"):
        validate_config({"run": name})
    assert validate_config({"run": "results"})["run"] == "results"  # per-job timings live under logs/<run>/ now


def test_replicas_per_gpu_needs_one_gpu_engines():
    assert validate_config({"vllm": {"replicas_per_gpu": 2}})["vllm"]["replicas_per_gpu"] == 2
    with pytest.raises(
        ConfigError, match=r"vllm.replicas_per_gpu 2 shares a GPU .* tensor_parallel_size x pipeline_parallel_size = 2 GPUs"
    ):
        validate_config({"vllm": {"replicas_per_gpu": 2, "tensor_parallel_size": 2}})


def test_result_and_runtime_settings_split_each_section_by_the_schema_marker():
    from eagle3_pipeline.config import load_schema, result_settings, runtime_keys, runtime_settings

    cfg = validate_config({})
    schema = load_schema()
    for section, spec in schema["properties"].items():
        if not isinstance(cfg.get(section), dict):
            continue
        marked = {k for k, v in spec.get("properties", {}).items() if v.get("x-result") is False}
        assert set(runtime_keys(section)) == marked
        res, run = result_settings(cfg, section), runtime_settings(cfg, section)
        assert set(res) | set(run) == set(cfg[section]) and not set(res) & set(run)
    # what changes no output is never a rule param: chunk sizes, replica layout, loader processes
    assert "chunk_prompts" not in result_settings(cfg, "generation") and "chunk_samples" in runtime_settings(cfg, "extraction")
    assert {"data_parallel_size", "replicas_per_gpu"} <= set(runtime_settings(cfg, "vllm"))
    assert "tensor_parallel_size" in result_settings(cfg, "vllm")  # changes numerics: a param
    assert "loader_workers" in runtime_settings(cfg, "training") and "lr" in result_settings(cfg, "training")


def test_config_readme_is_the_schema_reference():
    from eagle3_pipeline.config import load_schema, schema_reference

    doc = (Path(__file__).resolve().parents[1] / "config" / "README.md").read_text()
    assert doc == schema_reference(), "config/README.md is stale: run `make config-docs`"

    # every leaf key of the schema has its row
    def leaves(props, prefix=""):
        for k, v in props.items():
            yield from leaves(v["properties"], f"{prefix}{k}.") if "properties" in v else [f"{prefix}{k}"]

    keys = list(leaves(load_schema()["properties"]))
    assert len(keys) > 80 and all(f"| `{k}` |" in doc for k in keys)


def test_every_schema_property_uses_only_schema_keywords():
    """A YAML flow mapping splits an unquoted description at its commas into stray keys, which
    jsonschema ignores: every property schema holds JSON-schema keywords and x-result only."""
    from eagle3_pipeline.config import load_schema

    allowed = {"type", "default", "description", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
    allowed |= {"properties", "additionalProperties", "items", "x-result", "pattern", "minItems", "maxItems", "propertyNames"}
    allowed |= {"required", "oneOf", "anyOf", "allOf", "if", "then", "else", "minLength", "uniqueItems", "const", "not"}

    def walk(schema, path=""):
        for key, sub in schema.get("properties", {}).items():
            assert set(sub) <= allowed, f"{path}{key}: {sorted(set(sub) - allowed)}"
            walk(sub, f"{path}{key}.")

    walk(load_schema())


def test_job_settings_give_each_stage_its_gpus_and_result_params():
    from eagle3_pipeline.config import ConfigError, job_settings, validate_config

    cfg = validate_config({"vllm": {"data_parallel_size": 2, "replicas_per_gpu": 2}, "extraction": {"backend": "vllm"}})
    got = job_settings(cfg)
    assert (got["generation_gpus"], got["extraction_gpus"], got["evaluation_gpus"], got["train_processes"]) == (1, 1, 1, 1)
    assert cfg["extraction"]["data_parallel_size"] == 2 and cfg["extraction"]["gpus_per_replica"] == 1  # filled in
    assert got["extraction_params"]["engine"] == got["vllm_params"] and "batch_tokens" not in got["extraction_params"]
    hf = job_settings(validate_config({"vllm": {"tensor_parallel_size": 2}, "resources": {"train_gpus": 2}}))
    assert (hf["generation_gpus"], hf["extraction_gpus"], hf["evaluation_gpus"], hf["train_processes"]) == (2, 2, 2, 2)
    assert "engine" not in hf["extraction_params"] and "batch_tokens" in hf["extraction_params"]
    with pytest.raises(ConfigError, match="extraction.gpus_per_replica=2 but the vllm backend's replica is one engine"):
        job_settings(validate_config({"extraction": {"backend": "vllm", "gpus_per_replica": 2}}))


def test_the_run_and_every_variant_are_checked_against_the_target():
    from eagle3_pipeline.config import check_run_against_target

    run = validate_config({})
    big = validate_config({"vocab": {"draft_vocab_size": 60000}})
    check_run_against_target(run, {"ok": run}, 30, 49152)
    with pytest.raises(
        ConfigError, match=r"^sweep\.variants\.big: invalid configuration for this target:\n  vocab\.draft_vocab_size: 60000"
    ):
        check_run_against_target(run, {"ok": run, "big": big}, 30, 49152)
    with pytest.raises(ConfigError, match=r"^invalid configuration for this target"):  # the run's own first
        check_run_against_target(big, {"big": big}, 30, 49152)


def test_evaluation_k_and_engine_settings():
    from eagle3_pipeline.config import evaluation_vllm, num_speculative_tokens

    cfg = validate_config({"training": {"ttt_steps": 4}})
    assert num_speculative_tokens(cfg) == 4  # the drafter's TTT steps when not set
    assert num_speculative_tokens(validate_config({"training": {"ttt_steps": 4}, "evaluation": {"num_speculative_tokens": 2}})) == 2
    vllm = {"enforce_eager": False, "tensor_parallel_size": 2}
    assert evaluation_vllm(cfg, vllm) == vllm
    eager = evaluation_vllm(validate_config({"evaluation": {"enforce_eager": True}}), vllm)
    assert eager == {"enforce_eager": True, "tensor_parallel_size": 2} and vllm["enforce_eager"] is False  # a copy


def test_library_errors_reach_snakemake_as_workflow_errors():
    from snakemake.exceptions import WorkflowError

    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.snakemake_adapter import workflow_errors

    with pytest.raises(WorkflowError, match=r"^target\.path: no such directory$"), workflow_errors("target.path"):
        raise InputError("no such directory")
    with pytest.raises(WorkflowError, match=r"^run: not a folder name$"), workflow_errors():
        raise ConfigError("run: not a folder name")
    with pytest.raises(KeyError), workflow_errors():  # a bug stays a traceback
        raise KeyError("x")
    with workflow_errors():
        pass


def test_the_configured_target_directory_identity_and_shape(tmp_path):
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.layout import BUILTIN_TARGET_DIR
    from eagle3_pipeline.target_model import (
        BUILTIN_SHAPE,
        BUILTIN_TARGET,
        configured_target_dir,
        configured_target_identity,
        configured_target_shape,
        init_drafter_identity,
        quick_identity,
    )

    assert configured_target_dir(BUILTIN_TARGET) == BUILTIN_TARGET_DIR
    assert configured_target_identity(BUILTIN_TARGET) == BUILTIN_TARGET  # not materialized yet at DAG time
    assert configured_target_shape(BUILTIN_TARGET) == BUILTIN_SHAPE == (30, 49152)
    with pytest.raises(InputError):
        configured_target_dir(str(tmp_path / "missing"))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    assert init_drafter_identity(None) is None
    with pytest.raises(InputError, match=r"is not a drafter directory \(no config\.json\)"):
        init_drafter_identity(str(drafter))
    (drafter / "config.json").write_text("{}")
    assert init_drafter_identity(str(drafter)) == quick_identity(drafter)


@pytest.mark.parametrize(
    ("config_json", "expected"),
    [
        ('{"num_hidden_layers": 4,', r"config\.json \(line 1, column 25\): not valid JSON"),
        ("[4, 1000]", r"config\.json: holds a JSON list, not an object"),
        ('{"num_hidden_layers": "4", "vocab_size": 1000}', r"config\.json: num_hidden_layers is '4', not a positive integer"),
        ('{"num_hidden_layers": 4, "vocab_size": 0}', r"config\.json: vocab_size is 0, not a positive integer"),
        ('{"num_hidden_layers": 4}', r"config\.json has no vocab_size"),
    ],
)
def test_a_target_config_json_the_dag_cannot_read_is_an_error_naming_the_file(tmp_path, config_json, expected):
    """The shape checks read config.json as plain JSON when the DAG is built: a malformed or mistyped
    one was a raw JSONDecodeError or ValueError from rules/common.smk (found by editing the file)."""
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.target_model import configured_target_model_type, configured_target_shape

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4, "vocab_size": 1000, "text_config": "x", "model_type": "llama"}')
    assert configured_target_shape(str(tmp_path)) == (4, 1000) and configured_target_model_type(str(tmp_path)) == "llama"
    (tmp_path / "config.json").write_text(config_json)
    with pytest.raises(InputError, match=expected) as e:
        configured_target_shape(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_command_line_strings_become_the_schema_types_in_lists_too():
    """`--config` hands every nested scalar over as a string, list items included."""
    cfg = validate_config(
        {
            "extraction": {"aux_layer_ids": ["1", "15", "27"], "data_parallel_size": "2"},
            "vllm": {"enforce_eager": "false"},
            "training": {"lr": "1e-4"},
            "prompts": {"sources": [{"type": "builtin_sharegpt"}]},
        }
    )
    assert cfg["extraction"]["aux_layer_ids"] == [1, 15, 27] and cfg["extraction"]["data_parallel_size"] == 2
    assert cfg["vllm"]["enforce_eager"] is False and cfg["training"]["lr"] == 1e-4
    assert cfg["prompts"]["sources"] == [{"type": "builtin_sharegpt"}]
    with pytest.raises(ConfigError, match=r"extraction.aux_layer_ids.1: 'x' is not of type 'integer'"):
        validate_config({"extraction": {"aux_layer_ids": ["1", "x", "27"]}})


def test_speedup_concurrencies_are_measured_in_ascending_order():
    assert validate_config({"evaluation": {"speedup": {"concurrency": [64, 1, 16]}}})["evaluation"]["speedup"]["concurrency"] == [1, 16, 64]
    with pytest.raises(ConfigError, match="non-unique"):
        validate_config({"evaluation": {"speedup": {"concurrency": [4, 4]}}})


def test_the_same_settings_in_another_key_order_give_the_same_params():
    # Snakemake compares params by repr, where a dict's key order shows: a prompt source written
    # {path, type}, a section's keys in another order or a default written out must not rerun jobs
    from eagle3_pipeline.config import job_settings, result_settings

    a = {
        "prompts": {"sources": [{"type": "file", "path": "/p.jsonl"}], "num_shards": 2},
        "training": {"epochs": 2, "optimizer": "adamw"},
        "vllm": {"extra_engine_args": {"block_size": 16, "kv_cache_dtype": "auto"}},
        "sweep": {"variants": {"zz": {"training": {"epochs": 1, "ttt_steps": 2}}, "aa": {"vocab": {"draft_vocab_size": 256}}}},
    }
    lr = validate_config({})["training"]["lr"]
    b = {
        "sweep": {"variants": {"zz": {"training": {"ttt_steps": 2, "epochs": 1}}, "aa": {"vocab": {"draft_vocab_size": 256}}}},
        "vllm": {"extra_engine_args": {"kv_cache_dtype": "auto", "block_size": 16}},
        "training": {"lr": lr, "optimizer": "adamw", "epochs": 2},
        "prompts": {"num_shards": 2, "sources": [{"path": "/p.jsonl", "type": "file"}]},
    }
    ca, cb = validate_config(a), validate_config(b)
    assert repr(ca) == repr(cb)
    assert repr(job_settings(ca)) == repr(job_settings(cb))
    assert repr(result_settings(ca, "training")) == repr(result_settings(cb, "training"))
    # keys in the shipped config's order, then the schema's, free keys sorted; the variants as written
    # (reports list them so). The shipped config's order first: Snakemake merges a user's config over
    # it and the schema's defaults came after, so runs made before keep their params
    shipped = yaml.safe_load((Path(__file__).parents[1] / "config" / "config.yaml").read_text())
    schema = yaml.safe_load((Path(__file__).parents[1] / "config" / "schema.yaml").read_text())
    assert list(ca) == list(shipped) + [k for k in schema["properties"] if k in ca and k not in shipped]
    for name, section in shipped.items():
        if isinstance(section, dict):
            rest = [k for k in schema["properties"][name].get("properties", {}) if k in ca[name] and k not in section]
            assert list(ca[name]) == list(section) + rest, name
    assert list(ca["prompts"]["sources"][0]) == ["type", "path"]
    assert list(ca["vllm"]["extra_engine_args"]) == ["block_size", "kv_cache_dtype"]
    assert list(ca["sweep"]["variants"]) == ["zz", "aa"]
    assert ca["training"]["epochs"] == 2 and ca["sweep"]["variants"]["zz"]["training"] == {"epochs": 1, "ttt_steps": 2}


def test_a_device_is_auto_cpu_or_a_cuda_device_torch_sees():
    import torch

    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.precision import check_device_available

    for key in ("training", "extraction"):
        with pytest.raises(ConfigError, match=rf"{key}.device: 'gpu' does not match"):
            validate_config({key: {"device": "gpu"}})
        assert validate_config({key: {"device": "cuda:1"}})[key]["device"] == "cuda:1"
    n = torch.cuda.device_count()
    for device in ("auto", "cpu", *[f"cuda:{i}" for i in range(n)]):
        check_device_available(device, "training.device")
    with pytest.raises(InputError, match=rf"^extraction.device: 'cuda:{n}', but torch .* sees {n} CUDA device\(s\) on this host"):
        check_device_available(f"cuda:{n}", "extraction.device")


def test_more_shards_than_prompts_is_refused_at_validation():
    """prompts.num_shards above prompts.max_prompts was found by prepare_prompts' job ("3 prompts
    cannot fill 8 shards") after the dry run had planned 8 generation jobs: a limit the config
    states is checked with the config. Without max_prompts the count is the sources' (the job's)."""
    with pytest.raises(ConfigError, match=r"prompts.num_shards 8 is more than prompts.max_prompts 3: .*lower prompts.num_shards"):
        validate_config({"prompts": {"max_prompts": 3, "num_shards": 8}})
    assert validate_config({"prompts": {"max_prompts": 8, "num_shards": 8}})["prompts"]["num_shards"] == 8
    assert validate_config({"prompts": {"max_prompts": None, "num_shards": 8}})["prompts"]["num_shards"] == 8


def test_min_completion_tokens_must_leave_room_for_a_prompt():
    with pytest.raises(ConfigError, match=r"generation.min_completion_tokens 512 leaves no room for a prompt within max_seq_len 512"):
        validate_config({"max_seq_len": 512, "generation": {"min_completion_tokens": 512}})
    assert validate_config({"max_seq_len": 512, "generation": {"min_completion_tokens": 511}})["generation"]["min_completion_tokens"] == 511


def test_evaluation_max_tokens_must_leave_room_for_a_prompt():
    """Refused when the config is read, not in evaluate_drafter after every other stage."""
    with pytest.raises(ConfigError, match=r"evaluation.max_tokens 5000 leaves no room for a prompt within max_seq_len 2048"):
        validate_config({"max_seq_len": 2048, "evaluation": {"max_tokens": 5000}})
    with pytest.raises(ConfigError, match=r"evaluation.max_tokens 512 leaves no room"):
        validate_config({"max_seq_len": 512, "evaluation": {"max_tokens": 512}})
    assert validate_config({"max_seq_len": 512, "evaluation": {"max_tokens": 511}})["evaluation"]["max_tokens"] == 511

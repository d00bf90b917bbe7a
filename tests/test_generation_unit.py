"""Prompt rendering, reasoning split, spec-decode counter parsing and decoding throughput (no engine needed)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.config import validate_config
from eagle3_pipeline.evaluation import (
    acceptance_report,
    decode_throughput,
    eval_prompt_ids,
    fit_prompts,
    run_eval,
    spec_decode_counters,
    speedup_table,
    throughput_runs,
)
from eagle3_pipeline.generation import render_prompt_ids, split_reasoning


def test_render_prompt_ids_decodes_to_the_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = render_prompt_ids(tokenizer, msgs)
    assert all(isinstance(i, int) for i in ids)
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == text
    # SmolLM2's template adds its default system prompt and ends with the assistant header
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_render_prompt_ids_requires_a_template(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt_ids(tok, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        ("<think>plan</think>\n\nThe answer.", "plan", "The answer."),
        ("plan</think>The answer.", "plan", "The answer."),  # opening tag was in the template
        ("<think>still thinking", "still thinking", ""),  # truncated inside reasoning
        ("Just an answer.", None, "Just an answer."),
    ],
)
def test_split_reasoning(text, reasoning, answer):
    assert split_reasoning(text) == (reasoning, answer)


def test_spec_decode_counters_and_tau():
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    metrics = [
        Counter(name="vllm:spec_decode_num_drafts", labels={"engine": "0"}, value=10),
        Counter(name="vllm:spec_decode_num_draft_tokens", labels={"engine": "0"}, value=30),
        Counter(name="vllm:spec_decode_num_accepted_tokens", labels={"engine": "0"}, value=12),
        Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={"engine": "0"}, values=[7, 4, 1]),
        Gauge(name="vllm:num_requests_running", labels={"engine": "0"}, value=0),
    ]
    c = spec_decode_counters(metrics)
    assert c == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12, "accepted_per_position": [7, 4, 1]}
    rep = acceptance_report(c, 3)
    assert rep["acceptance_length"] == pytest.approx(1 + 12 / 10)
    assert rep["per_position_acceptance_rate"] == pytest.approx([0.7, 0.4, 0.1])
    assert rep["draft_acceptance_rate"] == pytest.approx(0.4)


def test_missing_counters_are_an_error():
    with pytest.raises(RuntimeError, match="no spec_decode counters"):
        spec_decode_counters([])
    with pytest.raises(RuntimeError, match="no drafts"):
        acceptance_report({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}, 3)


def test_null_chat_template_is_no_chat_template(tmp_path, target_dir):
    import json
    import shutil

    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.target_model import check_target_dir

    d = tmp_path / "t"
    shutil.copytree(target_dir, d)
    (d / "chat_template.jinja").unlink()
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": None}))
    with pytest.raises(InputError, match="has no chat template"):
        check_target_dir(d)


def test_wrong_model_path_is_a_clear_error(tmp_path):
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.target_model import check_target_dir

    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "README.md").write_text("hi")
    with pytest.raises(InputError, match="has no config.json; target.path must be a Hugging Face model directory"):
        check_target_dir(tmp_path / "notamodel")
    (tmp_path / "notamodel" / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"has no weights \(\*\.safetensors or \*\.bin\)"):
        check_target_dir(tmp_path / "notamodel")


class _FakeEngine:
    """An engine that answers each request with ``length`` tokens, one per step, and records how many were in flight."""

    def __init__(self, length: int):
        self.length, self.running, self.max_in_flight, self.added = length, {}, 0, []

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params.max_tokens))
        self.running[request_id] = 0
        self.max_in_flight = max(self.max_in_flight, len(self.running))

    def get_num_unfinished_requests(self):
        return len(self.running)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        done = []
        for rid in list(self.running):
            self.running[rid] += 1
            if self.running[rid] == self.length:
                del self.running[rid]
                done.append(SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(token_ids=[7] * self.length)]))
        return done


@pytest.mark.parametrize("concurrency", [1, 3, 64])
def test_decode_throughput_keeps_the_asked_requests_in_flight(concurrency):
    llm = SimpleNamespace(llm_engine=_FakeEngine(length=5))
    prompts = [[1, 2, 3, i] for i in range(10)]
    r = decode_throughput(llm, prompts, max_tokens=5, concurrency=concurrency)
    eng = llm.llm_engine
    assert eng.max_in_flight == min(concurrency, len(prompts))
    assert [p for _, p, _ in eng.added] == prompts and {m for _, _, m in eng.added} == {5}
    assert len({rid for rid, _, _ in eng.added}) == 10  # request ids unique
    assert r["requests"] == 10 and r["output_tokens"] == 50 and r["concurrency"] == concurrency
    assert r["output_tokens_per_second"] > 0


def test_speedup_table_pairs_levels_and_divides():
    w = [
        {"concurrency": 1, "requests": 4, "output_tokens_per_second": 30.0},
        {"concurrency": 16, "requests": 4, "output_tokens_per_second": 200.0},
    ]
    b = [
        {"concurrency": 1, "requests": 4, "output_tokens_per_second": 20.0},
        {"concurrency": 16, "requests": 4, "output_tokens_per_second": 250.0},
    ]
    rows = speedup_table(w, b)
    assert [(r["concurrency"], r["speedup"]) for r in rows] == [(1, 1.5), (16, 0.8)]
    with pytest.raises(ValueError, match="concurrency 16 measured with the drafter, 1 without"):
        speedup_table(w[::-1], b)


def test_throughput_runs_follow_the_speedup_settings():
    llm = SimpleNamespace(llm_engine=_FakeEngine(length=2))
    cfg = {"max_tokens": 2, "temperature": 0.0, "speedup": {"concurrency": [1, 4], "max_prompts": 3}}
    runs = throughput_runs(llm, [[1, 2, 3, i] for i in range(8)], cfg, "test", warm_up=True)
    assert [(r["concurrency"], r["requests"]) for r in runs] == [(1, 3), (4, 3)]
    assert len(llm.llm_engine.added) == 2 + 3 + 3  # the warm-up's two, then each level's three
    assert throughput_runs(llm, [[1]], cfg | {"speedup": {"concurrency": [], "max_prompts": None}}, "none") == []


def test_fit_prompts_counts_each_prompt_without_room_for_the_answer():
    questions = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    prompts = [[1] * 30, [1] * 33, [1] * 34]
    kept, rejects = fit_prompts(questions, prompts, max_tokens=30, max_seq_len=63)
    assert kept == [0, 1]  # 33 + 30 = 63 fits exactly; 34 + 30 does not
    assert [r["id"] for r in rejects] == ["c"] and rejects[0]["reason"] == "prompt_too_long"
    assert "34 prompt tokens + evaluation.max_tokens 30 > max_seq_len 63" in rejects[0]["detail"]


def test_run_eval_refuses_when_no_prompt_fits_before_any_request(tokenizer):
    from eagle3_pipeline.io import InputError

    cfg = {"max_tokens": 256, "temperature": 0.0, "num_speculative_tokens": 3}
    with pytest.raises(InputError, match=r"no evaluation prompt fits: \d+ prompt tokens \+ evaluation.max_tokens 256 > max_seq_len 64"):
        questions = [{"id": "q1", "turns": ["Name the planets of the solar system."]}]
        run_eval(None, questions, eval_prompt_ids(tokenizer, questions), cfg, 64)


def test_run_eval_keeps_each_answer_with_its_question_when_answers_end_out_of_order(capsys):
    """τ's pass feeds every prompt to the engine at once with a bar over output tokens; answers
    end in any order (here the longest prompt's first) and each row stays its question's."""
    from vllm.v1.metrics.reader import Counter

    class Engine(_FakeEngine):  # request i answers with 6 - i tokens, text "a<i>"
        def step(self):
            done = []
            for rid in list(self.running):
                self.running[rid] += 1
                i = int(rid.rsplit("-", 1)[1])
                if self.running[rid] == 6 - i:
                    del self.running[rid]
                    done.append(
                        SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(token_ids=[7] * (6 - i), text=f"a{i}")])
                    )
            return done

    eng = Engine(length=0)
    counters = [
        Counter(name="vllm:spec_decode_num_drafts", labels={}, value=4),
        Counter(name="vllm:spec_decode_num_draft_tokens", labels={}, value=12),
        Counter(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=6),
        Counter(name="vllm:generation_tokens", labels={}, value=0),
    ]
    llm = SimpleNamespace(llm_engine=eng, get_metrics=lambda: counters)
    questions = [{"id": f"q{i}"} for i in range(4)]
    prompts = [[1] * (3 + i) for i in range(4)]
    cfg = {"max_tokens": 8, "temperature": 0.0, "num_speculative_tokens": 3}
    report, rows, rejects = run_eval(llm, questions, prompts, cfg, 64)
    assert eng.max_in_flight == 4 and [p for _, p, _ in eng.added] == prompts  # all at once, in order
    assert rows == [{"id": f"q{i}", "num_prompt_tokens": 3 + i, "num_output_tokens": 6 - i, "text": f"a{i}"} for i in range(4)]
    assert rejects == [] and report["num_prompts"] == 4 and report["output_tokens"] == 6 + 5 + 4 + 3
    assert report["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert "evaluate tau: 100%" in capsys.readouterr().err  # its bar, completed


class _SamplingEngine:
    """An engine that samples ``params.n`` answers per request: answer j is ``[seed % 1000, j % dup_every]``
    (``dup_every`` < n repeats answers), finishing every request at its first step."""

    def __init__(self, dup_every: int = 1000):
        self.dup_every, self.waiting, self.params = dup_every, [], {}

    def add_request(self, request_id, prompt, params):
        self.waiting.append((request_id, list(prompt["prompt_token_ids"]), params))
        self.params[request_id] = params

    def get_num_unfinished_requests(self):
        return len(self.waiting)

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def step(self):
        done, self.waiting = self.waiting, []
        out = []
        for rid, ids, p in done:
            comps = [
                SimpleNamespace(index=j, token_ids=[p.seed % 1000, j % self.dup_every], text=f"answer {j}", finish_reason="length")
                for j in range(p.n)
            ]
            out.append(SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=ids, outputs=comps[::-1]))  # any order
        return out


def _sampled(tokenizer, answers: int, dup_every: int = 1000, max_tokens: int = 8):
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.generation import generate_chunks

    gen = validate_config({"generation": {"temperature": 0.8, "answers_per_prompt": answers, "max_tokens": max_tokens}})["generation"]
    records = [{"id": f"{i:016x}", "source": "t", "messages": [{"role": "user", "content": f"question {i}"}]} for i in (3, 5)]
    eng = _SamplingEngine(dup_every)
    got = {}
    generate_chunks(
        SimpleNamespace(llm_engine=eng), tokenizer, records, [(0, 2)], [0], gen,
        max_seq_len=256, seed=11, engine={}, model={}, on_chunk=lambda i, res: got.setdefault(i, res),
    )  # fmt: skip
    return got[0], eng


def test_a_max_tokens_past_the_context_asks_each_request_for_the_room_its_prompt_leaves(tokenizer):
    """generation.max_tokens: 10^12 (no upper bound in the schema) generates as max_tokens: "the
    rest of the context" would: each request asks for max_seq_len (256) minus its prompt, and the
    progress bar's expected answer length is bounded by max_seq_len (it allocated 10^12 slots)."""
    res, eng = _sampled(tokenizer, 1, max_tokens=10**12)
    assert len(res.traces) == 2
    for t in res.traces:
        assert t["sampling"]["max_tokens"] == 256 - len(t["prompt_token_ids"]) > 0
    assert sorted(p.max_tokens for p in eng.params.values()) == sorted(256 - len(t["prompt_token_ids"]) for t in res.traces)


def test_each_sampled_answer_is_a_trace_of_its_own_with_a_stable_id(tokenizer):
    from eagle3_pipeline.conventions import prompt_of

    res, eng = _sampled(tokenizer, 3)
    ids = [t["id"] for t in res.traces]
    assert ids == [
        "0000000000000003",
        "0000000000000003-1",
        "0000000000000003-2",
        "0000000000000005",
        "0000000000000005-1",
        "0000000000000005-2",
    ]
    assert {prompt_of(i) for i in ids} == {"0000000000000003", "0000000000000005"}
    assert [t["completion_token_ids"][1] for t in res.traces] == [0, 1, 2] * 2  # answer j in order of its index
    assert all(p.n == 3 for p in eng.params.values())
    # a per-request seed from the run's seed and the prompt id: the same on a rerun, different per prompt
    seeds = [t["sampling"]["request_seed"] for t in res.traces]
    assert seeds[0] == seeds[1] == seeds[2] != seeds[3] and seeds == [
        t["sampling"]["request_seed"] for t in _sampled(tokenizer, 3)[0].traces
    ]
    assert sorted(p.seed for p in eng.params.values()) == sorted({seeds[0], seeds[3]})
    s = res.summary()
    assert (s["prompts"], s["ok"], s["rejected"]) == (2, 6, 0)


def test_a_repeated_answer_of_one_prompt_is_a_counted_reject(tokenizer):
    res, _ = _sampled(tokenizer, 3, dup_every=2)  # answer 2 repeats answer 0
    assert [t["id"] for t in res.traces] == ["0000000000000003", "0000000000000003-1", "0000000000000005", "0000000000000005-1"]
    assert [(r.reason, r.id, r.detail) for r in res.rejects] == [
        ("duplicate_answer", "0000000000000003-2", "the same tokens as answer 0000000000000003"),
        ("duplicate_answer", "0000000000000005-2", "the same tokens as answer 0000000000000005"),
    ]
    s = res.summary()
    assert (s["prompts"], s["ok"], s["rejects_by_reason"]) == (2, 4, {"duplicate_answer": 2})


def test_several_answers_need_sampling():
    from eagle3_pipeline.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"generation.answers_per_prompt 4 with generation.temperature 0 .* set temperature > 0"):
        validate_config({"generation": {"answers_per_prompt": 4}})
    assert validate_config({"generation": {"answers_per_prompt": 4, "temperature": 0.7}})["generation"]["answers_per_prompt"] == 4


def test_every_answer_of_a_prompt_lands_on_the_same_side_of_the_validation_split(tmp_path):
    import numpy as np
    import torch

    from eagle3_pipeline.conventions import answer_id, loss_mask
    from eagle3_pipeline.shards import Sample, ShardReader, write_shard
    from eagle3_pipeline.training import split_items

    def shard(name: str, ids: list[str]) -> ShardReader:
        samples = [Sample(i, np.arange(6), loss_mask(3, 3)) for i in ids]
        states = [torch.zeros(6, 2, 4, dtype=torch.bfloat16)] * len(ids)
        write_shard(tmp_path / name, samples, states, layer_ids=[1, 2], aux_layer_ids=[1], index_path=tmp_path / f"{name}.json")
        return ShardReader(tmp_path / name)

    prompts = [f"{i:016x}" for i in range(40)]
    r = shard("three.safetensors", [answer_id(p, j) for p in prompts for j in range(3)])
    train, val = split_items([r], 0.3)
    side = {}
    for part, items in (("train", train), ("val", val)):
        for _, i in items:
            side.setdefault(r.sample_ids[i].partition("-")[0], set()).add(part)
    assert len(side) == 40 and all(len(s) == 1 for s in side.values())
    assert 0 < len(val) < 120 and len(val) % 3 == 0
    # with one answer per prompt (sample id = prompt id) the same prompts are held out
    one = shard("one.safetensors", prompts)
    assert {one.sample_ids[i] for _, i in split_items([one], 0.3)[1]} == {p for p, s in side.items() if s == {"val"}}


@pytest.mark.parametrize(
    ("tokens", "start"),
    [
        (list(range(1, 21)) + [7, 8, 9] * 12, 20),  # a 3-token unit 12 times after an answer
        ([5] * 40, 0),
        (list(range(100)), None),
        (list(range(30)) + [7, 8] * 10, None),  # 20 looping tokens: fewer than LOOP_MIN_TOKENS
        (list(range(200, 264)) * 2 + [1], None),  # a 64-token unit twice, then another token
        (list(range(10)) + list(range(300, 340)) * 3, 10),  # a 40-token unit 3 times
    ],
)
def test_repetition_loop_finds_the_looping_tail(tokens, start):
    from eagle3_pipeline.conventions import repetition_loop

    assert repetition_loop(tokens) == start


def test_the_traces_summary_counts_answers_ending_in_a_loop():
    from eagle3_pipeline.generation import ShardResult

    def trace(i, comp, reason):
        return {"id": f"{i:016x}", "prompt_token_ids": [1], "completion_token_ids": comp, "finish_reason": reason, "reasoning": None}

    res = ShardResult(traces=[trace(0, [4] * 50, "length"), trace(1, list(range(50)), "stop"), trace(2, [1, 2] * 30, "stop")])
    s = res.summary()
    assert (s["ok"], s["truncated"], s["repetition_loops"]) == (3, 1, 2)


def test_a_target_vllm_cannot_draft_for_with_eagle3_is_refused_naming_its_architecture(tmp_path, target_dir):
    from transformers import AutoConfig

    from eagle3_pipeline.engine import check_eagle3_target
    from eagle3_pipeline.io import InputError

    assert check_eagle3_target(str(target_dir)) == "LlamaForCausalLM"
    cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(InputError, match=r"vLLM [0-9.]+\S*'s GPT2LMHeadModel has no EAGLE-3 support .* use a vLLM version"):
        check_eagle3_target(str(tmp_path / "gpt2"))
    cfg.architectures = ["NoSuchModelForCausalLM"]
    cfg.save_pretrained(tmp_path / "unknown")
    with pytest.raises(InputError, match=r"has no model class for NoSuchModelForCausalLM"):
        check_eagle3_target(str(tmp_path / "unknown"))
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    with pytest.raises(InputError, match=r"cannot load the config of \['FooForCausalLM'\] \(model_type 'foo'\).*trust_remote_code"):
        check_eagle3_target(str(tmp_path / "foo"))


def test_answer_ids_and_their_prompt():
    from eagle3_pipeline.conventions import answer_id, prompt_of

    pid = "0123456789abcdef"
    assert [answer_id(pid, j) for j in range(3)] == [pid, pid + "-1", pid + "-2"]
    assert {prompt_of(answer_id(pid, j)) for j in range(12)} == {pid}
    for other in ("s0-5", "0123456789abcdef-x", "abc-1", "0123456789abcdef0-1"):  # not an answer id: its own prompt
        assert prompt_of(other) == other


@pytest.mark.parametrize(
    ("model_type", "architecture", "supported"),
    [
        ("qwen3", "Qwen3ForCausalLM", True),
        ("qwen3_moe", "Qwen3MoeForCausalLM", True),
        ("deepseek_v3", "DeepseekV3ForCausalLM", True),
        ("mistral", "MistralForCausalLM", True),
        ("gpt_oss", "GptOssForCausalLM", True),
        ("gemma4_text", "Gemma4ForCausalLM", True),
        ("gemma3_text", "Gemma3ForCausalLM", False),
        ("gemma2", "Gemma2ForCausalLM", False),
    ],
)
def test_the_family_table_of_eagle3_support(tmp_path, model_type, architecture, supported):
    """docs/model-families.md's "vLLM eagle3" column, read from the installed vLLM's model classes."""
    from transformers import AutoConfig

    from eagle3_pipeline.engine import check_eagle3_target
    from eagle3_pipeline.io import InputError

    cfg = AutoConfig.for_model(model_type)
    cfg.architectures = [architecture]
    cfg.save_pretrained(tmp_path)
    if supported:
        assert check_eagle3_target(str(tmp_path)) == architecture
    else:
        with pytest.raises(InputError, match=rf"{architecture} has no EAGLE-3 support"):
            check_eagle3_target(str(tmp_path))


@pytest.mark.parametrize(
    ("case", "edit", "max_seq_len", "expected"),
    [
        ("a string for an int", {"hidden_size": "64"}, None, r"config\.json: transformers .* Field 'hidden_size' expected int, got str"),
        (
            "heads that do not divide",
            {"num_attention_heads": 7},
            None,
            r"config\.json: transformers .*not a multiple of the number of attention heads",
        ),
        ("no heads", {"num_attention_heads": 0}, None, r"config\.json: transformers .*ZeroDivisionError"),
        ("a dtype torch lacks", {"torch_dtype": "float7", "dtype": "float7"}, None, r"config\.json: transformers .*float7"),
        (
            "a context below max_seq_len",
            {"max_position_embeddings": 512},
            2048,
            r"max_seq_len 2048 exceeds the context length of .* \(512 tokens",
        ),
        (
            "a zero context",
            {"max_position_embeddings": 0},
            None,
            r"cannot build its model config for LlamaForCausalLM .*max_model_len must be a positive integer",
        ),
        (
            "architectures as a string",
            {"architectures": "LlamaForCausalLM"},
            None,
            r"cannot build its model config for LlamaForCausalLM .*valid list",
        ),
        ("an unknown architecture first", {"architectures": ["FooForCausalLM", "LlamaForCausalLM"]}, None, None),
        ("no architectures", {"architectures": []}, None, r"names no architectures; .*add the checkpoint's own, e\.g\. \"architectures\""),
        ("not JSON", "{'hidden_size': 64", None, r"config\.json \(line 1, column 2\): not valid JSON"),
        ("a JSON list", "[1, 2]", None, r"config\.json: holds a JSON list, not an object"),
    ],
)
def test_an_edited_target_config_is_refused_naming_the_file_and_value(tmp_path, case, edit, max_seq_len, expected):
    """Values transformers or vLLM reject, found by trying edited config.json files: each was a raw
    traceback at generation's engine start, or (a short context) accepted by the check first. vLLM
    picks the first architecture it knows, and so does the check."""
    from transformers import AutoConfig

    from eagle3_pipeline.engine import check_eagle3_target
    from eagle3_pipeline.io import InputError

    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        vocab_size=1000, max_position_embeddings=4096,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    assert check_eagle3_target(str(tmp_path), max_seq_len=4096) == "LlamaForCausalLM"
    f = tmp_path / "config.json"
    f.write_text(edit if isinstance(edit, str) else json.dumps(json.loads(f.read_text()) | edit))
    if expected is None:
        assert check_eagle3_target(str(tmp_path), max_seq_len=max_seq_len) == "LlamaForCausalLM"
        return
    with pytest.raises(InputError, match=expected) as e:
        check_eagle3_target(str(tmp_path), max_seq_len=max_seq_len)
    assert str(tmp_path) in str(e.value)


def test_a_target_whose_weights_files_cannot_be_read_is_refused_naming_each(tmp_path):
    """An interrupted copy: vLLM's model config read an empty safetensors file's header and failed
    with "unpack requires a buffer of 8 bytes", which the check reported as a config.json problem."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from eagle3_pipeline.engine import check_eagle3_target
    from eagle3_pipeline.io import InputError

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / shards[0])
    save_file({"model.norm.weight": torch.zeros(2)}, tmp_path / shards[1])
    index = {"metadata": {}, "weight_map": {"lm_head.weight": shards[0], "model.norm.weight": shards[1]}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert check_eagle3_target(str(tmp_path)) == "LlamaForCausalLM"
    full = (tmp_path / shards[1]).read_bytes()
    (tmp_path / shards[1]).write_bytes(full[:5])  # cut inside the header's length
    index["weight_map"]["model.embed_tokens.weight"] = shards[2]  # a shard never copied
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError) as e:
        check_eagle3_target(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path}: 2 weights file(s) cannot be read") and "download them again" in msg
    assert f"{tmp_path / shards[1]}: not a readable safetensors file" in msg
    assert f"{tmp_path / shards[2]}: named by model.safetensors.index.json, missing" in msg
    assert shards[0] not in msg


def test_the_runs_start_checks_a_users_target_only_where_generation_is_pending_and_vllm_has_a_platform(
    tmp_path, monkeypatch, capsys, target_dir
):
    """snakemake_adapter.check_at_start, the onstart hook (the CLI run is tests/test_workflow_dag.py)."""
    import shutil

    from snakemake.exceptions import WorkflowError
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    from eagle3_pipeline import snakemake_adapter

    cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    for f in target_dir.iterdir():  # a tokenizer that renders prompts (checked first)
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, tmp_path)
    config = validate_config({"max_seq_len": 512})
    pending = [{"rule": "prepare_prompts"}, {"rule": "generate_traces"}]
    with pytest.raises(WorkflowError, match=r"GPT2LMHeadModel has no EAGLE-3 support.*Checked at the run's start: nothing was run"):
        snakemake_adapter.check_at_start(pending, config, str(tmp_path))
    snakemake_adapter.check_at_start(pending, config, None)  # the embedded target: a job makes it
    pending[1] = {"rule": "train_drafter"}  # generation done: its check ran then
    snakemake_adapter.check_at_start(pending, config, str(tmp_path))
    pending[1] = {"rule": "generate_traces"}
    monkeypatch.setattr(current_platform, "is_unspecified", lambda: True)  # a login node without GPUs
    snakemake_adapter.check_at_start(pending, config, str(tmp_path))
    assert "the target is checked in generation's job" in capsys.readouterr().err


def test_a_target_config_the_engine_cannot_read_is_refused_before_any_engine(tmp_path, monkeypatch):
    """vLLM 0.26 failed inside the first engine on Gemma-4 (H100, benchmarks/results/families_h100.json):
    it reads the per-layer ``head_dim`` of transformers' heterogeneous config as a global value. A
    vLLM that knows no per-layer configs is made here by treating every config as homogeneous, as
    0.26 did; the check then refuses the target with the architecture and what to do."""
    import vllm.config  # noqa: F401 - vLLM's own import order (the convertor module alone imports circularly)
    from transformers import AutoConfig
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    from eagle3_pipeline.engine import check_eagle3_target
    from eagle3_pipeline.io import InputError

    cfg = AutoConfig.for_model("gemma4_text", num_hidden_layers=4)
    cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    assert cfg.is_heterogeneous
    assert check_eagle3_target(str(tmp_path)) == "Gemma4ForCausalLM"  # this vLLM reads per-layer configs
    monkeypatch.setattr(ModelArchConfigConvertorBase, "get_per_layer_hf_configs", lambda self: None)
    with pytest.raises(InputError) as e:
        check_eagle3_target(str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path) in msg and "cannot build its model config for Gemma4ForCausalLM" in msg
    assert "AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute" in msg
    assert "per-layer attributes (a heterogeneous config)" in msg and "install a vLLM version" in msg
    from eagle3_pipeline.vllm_extraction import extraction_max_model_len

    with pytest.raises(InputError, match="cannot build its model config for Gemma4ForCausalLM"):  # the vllm backend's engine
        extraction_max_model_len(str(tmp_path), 512, False)


@pytest.mark.parametrize("concurrency", [[1, 2], []])
def test_the_evaluation_job_runs_the_drafters_engine_then_the_targets_alone(tmp_path, monkeypatch, concurrency):
    """run_evaluation's lifecycle with the engines faked: stale engines ended and the GPUs checked under the
    lock, each engine recorded in the run's .pids while it runs, the target's own engine only for a speedup."""
    import json

    from eagle3_pipeline import engine, evaluation, hygiene, target_model
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.io import record_files
    from eagle3_pipeline.layout import RunLayout

    monkeypatch.setenv("EAGLE3_LOCK_DIR", str(tmp_path / "locks"))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    record_files(drafter)
    questions = [{"id": f"q{i}", "turns": [f"question {i}?"]} for i in range(3)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "train.json").write_text(json.dumps({"final_val": {"loss": 1.25}}))
    layout = RunLayout.at(tmp_path / "results" / "r")
    record = Path(layout.pids()) / "evaluate_drafter-v1.json"  # a variant's engines are the run's records
    events = []

    def build_llm(model, vllm_cfg, *, seed, max_model_len, trust_remote_code, speculative_config=None):
        events.append(("build", None if speculative_config is None else speculative_config["num_speculative_tokens"]))
        return SimpleNamespace(llm_engine=_FakeEngine(length=4))

    def run_eval(llm, qs, prompts, eval_cfg, max_seq_len):
        events.append(("eval", record.exists()))
        rows = [{"id": q["id"], "num_output_tokens": 4} for q in qs[:2]]
        return {"acceptance_length": 1.5, "num_drafts": 10}, rows, [{"id": qs[2]["id"], "reason": "prompt_too_long"}]

    monkeypatch.setattr(engine, "build_llm", build_llm)
    monkeypatch.setattr(engine, "shutdown_llm", lambda llm: events.append(("shutdown", record.exists())))
    monkeypatch.setattr(engine, "engine_identity", lambda: {"name": "vllm", "version": "test", "platform": "cpu"})
    monkeypatch.setattr(target_model, "load_tokenizer", lambda path, trust: None)
    monkeypatch.setattr(evaluation, "eval_prompt_ids", lambda tok, qs, kwargs: [[5] * 8 for _ in qs])
    monkeypatch.setattr(evaluation, "run_eval", run_eval)
    monkeypatch.setattr(hygiene, "cleanup_stale_processes", lambda pid_dir: events.append(("cleanup", Path(pid_dir))))
    monkeypatch.setattr(hygiene, "check_gpus_free", lambda: events.append(("gpus",)))
    cfg = validate_config({"evaluation": {"speedup": {"concurrency": concurrency}}})
    params = {
        "evaluation": cfg["evaluation"],
        "num_speculative_tokens": 3,
        "generation": cfg["generation"],
        "vllm": cfg["vllm"],
        "seed": 0,
        "max_seq_len": 512,
        "trust_remote_code": False,
    }
    out = {k: str(tmp_path / "eval" / f"{k}.json") for k in ("acceptance", "outputs", "rejects")}
    report = evaluation.run_evaluation(
        str(drafter), str(tmp_path / "prompts.jsonl"), "target", str(tmp_path / "train.json"), out, params, layout=layout, variant="v1"
    )
    engines = [("build", 3), ("eval", True), ("shutdown", True)] + ([("build", None), ("shutdown", True)] if concurrency else [])
    assert events == [("cleanup", Path(layout.pids())), ("gpus",), *engines]
    assert not record.exists()  # cleared after each engine's shutdown
    assert json.loads(Path(out["acceptance"]).read_text()) == report
    assert report["drafter"] == str(drafter.resolve()) and report["offline_validation"] == {"loss": 1.25}
    assert report["engine"]["version"] == "test" and report["acceptance_length"] == 1.5
    assert [r["concurrency"] for r in report.get("speedup", [])] == concurrency
    assert [json.loads(x)["id"] for x in Path(out["outputs"]).read_text().splitlines()] == ["q0", "q1"]
    assert [json.loads(x)["id"] for x in Path(out["rejects"]).read_text().splitlines()] == ["q2"]


def _small_llama(folder, **config):
    """A 3-layer random Llama saved as transformers saves it (one safetensors file), and its state dict's names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128, **config,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    return set(model.state_dict())


def test_a_config_json_that_is_not_the_weights_is_refused_before_any_engine(tmp_path):
    """A config.json edited or copied from another checkpoint: vLLM failed inside generation's engine
    ("weights were not initialized from checkpoint"), after Snakemake had deleted the earlier traces
    (a changed target reruns generation)."""
    from eagle3_pipeline.engine import check_eagle3_target
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.target_model import weights_config_problems

    names = _small_llama(tmp_path)
    assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == {0, 1, 2}  # what the checks read
    assert weights_config_problems(tmp_path, 3, 32) == [] and check_eagle3_target(str(tmp_path)) == "LlamaForCausalLM"
    assert weights_config_problems(tmp_path, 5, 32) == [
        "config.json has 5 hidden layers; no weights for layer(s) 3-4 (the weights hold layers 0 to 2 under model.layers)"
    ]
    assert weights_config_problems(tmp_path, 1, 32) == [
        "config.json has 1 hidden layers; weights for layer(s) 1-2 too (the weights hold layers 0 to 2 under model.layers)"
    ]
    assert weights_config_problems(tmp_path, 2, 32, extra_layers=1) == []  # DeepSeek-V3's stored MTP layer
    assert weights_config_problems(tmp_path, 3, 64) == [
        "config.json has hidden_size 64; the token embedding model.embed_tokens.weight is 128 x 32"
    ]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(json.loads(f.read_text()) | {"num_hidden_layers": 4}))
    with pytest.raises(InputError) as e:
        check_eagle3_target(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path}: config.json does not match the weights:\n  config.json has 4 hidden layers; ")
    assert "no weights for layer(s) 3 " in str(e.value) and "copy its config.json again" in str(e.value)


def test_a_torch_checkpoint_cut_short_or_empty_is_named(tmp_path):
    """``pytorch_model.bin`` weights (torch's zip format): a truncated copy failed inside generation's
    engine with "PytorchStreamReader failed reading zip archive"."""
    import torch

    from eagle3_pipeline.target_model import weight_file_problems

    f = tmp_path / "pytorch_model.bin"
    torch.save({"model.norm.weight": torch.ones(1000)}, f)
    assert weight_file_problems(tmp_path) == []
    whole = f.read_bytes()
    f.write_bytes(whole[: len(whole) // 2])
    (problem,) = weight_file_problems(tmp_path)
    assert problem.startswith(f"{f}: not a readable torch checkpoint (its zip directory: ")
    f.write_bytes(b"")
    assert weight_file_problems(tmp_path) == [f"{f}: empty"]
    f.write_bytes(whole)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "pytorch_model.bin", "b": "x.bin"}}))
    assert weight_file_problems(tmp_path) == [f"{tmp_path / 'x.bin'}: named by pytorch_model.bin.index.json, missing"]


@pytest.mark.parametrize(
    ("case", "edit", "expected"),
    [
        ("tokenizer.json cut short", lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": {'), r"tokenizer\.json \(line 1, column 30\): not valid JSON"),
        ("no tokenizer files", lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")], r"\(\w+Error: "),
        ("generation_config.json cut short", lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [1, '), r"generation_config\.json \(line 1, column 22\): not valid JSON"),
        ("a template that does not parse", lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }"), r"\(TemplateSyntaxError: "),
    ],
)  # fmt: skip
def test_a_tokenizer_that_cannot_render_a_prompt_is_named_at_the_runs_start(tmp_path, target_dir, case, edit, expected):
    """Each was a traceback (or every prompt rejected) in generation's job after its engine started."""
    import shutil

    from snakemake.exceptions import WorkflowError

    from eagle3_pipeline import snakemake_adapter
    from eagle3_pipeline.target_model import tokenizer_problem

    d = tmp_path / "t"
    shutil.copytree(target_dir, d)
    assert tokenizer_problem(d) is None
    edit(d)
    why = tokenizer_problem(d)
    assert why is not None and why.startswith(str(d)) and re.search(expected, why), why
    assert "Copy the tokenizer files and chat template of the checkpoint again" in why
    pending = [{"rule": "generate_traces"}]
    with pytest.raises(WorkflowError, match=expected + r".*Checked at the run's start: nothing was run"):
        snakemake_adapter.check_at_start(pending, {"target": {"trust_remote_code": False}, "max_seq_len": 512}, str(d))


def test_target_path_mistakes_are_named(tmp_path, target_dir, monkeypatch):
    """A file for the folder, a path with ~, a tokenizer_config.json that is not JSON (a traceback from
    rules/common.smk, found by corrupting it), GPT-2's n_layer for num_hidden_layers."""
    import shutil

    from transformers import GPT2Config

    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.target_model import check_target_dir, target_shape

    with pytest.raises(InputError, match=r"target\.path .*config\.json is a file; set target\.path to the model folder"):
        check_target_dir(target_dir / "config.json")
    monkeypatch.setenv("HOME", str(target_dir.parent))
    assert check_target_dir(f"~/{target_dir.name}") == target_dir
    d = tmp_path / "t"
    shutil.copytree(target_dir, d)
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text('{"chat_template": ')
    with pytest.raises(InputError, match=r"tokenizer_config\.json \(line 1, column 19\): not valid JSON"):
        check_target_dir(d)
    GPT2Config(n_layer=5, n_embd=32, n_head=2, vocab_size=300).save_pretrained(tmp_path / "gpt2")
    assert "num_hidden_layers" not in json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert target_shape(tmp_path / "gpt2") == (5, 300)


def test_a_training_loss_speculators_does_not_know_stops_the_run_at_its_start():
    """training.loss is speculators' spec (a name or a JSON weighted combination): a typo failed in
    train_drafter's job, after generation and extraction; now the run's start refuses it, for the
    run's own training and for a sweep variant's."""
    from snakemake.exceptions import WorkflowError

    from eagle3_pipeline import snakemake_adapter

    train = {"rule": "train_drafter", "stage": "train_drafter", "wildcards": {}}
    ok = validate_config({"training": {"loss": '{"ce": 0.1, "tv": 0.9}'}, "sweep": {"variants": {"b": {"training": {"loss": "kl"}}}}})
    assert snakemake_adapter.problem_at_start([train], ok, None) is None  # the variant's training is not pending
    variant = {"rule": "train_drafter_variant", "stage": "train_drafter", "wildcards": {"variant": "b"}}
    with pytest.raises(
        WorkflowError, match=r"^sweep.variants.b.training.loss: 'kl' is not a loss speculators knows: .*kl_div.*nothing was run"
    ):
        snakemake_adapter.check_at_start([train, variant], ok, None)
    for bad in ("foo", '{"ce": "x"}', '{"nope": 1}'):
        why = snakemake_adapter.problem_at_start([train], validate_config({"training": {"loss": bad}}), None)
        assert why is not None and why.startswith(f"training.loss: {bad!r} is not a loss speculators knows: "), why
    assert snakemake_adapter.problem_at_start([{"rule": "generate_traces"}], validate_config({"training": {"loss": "foo"}}), None) is None


def test_a_warm_start_drafter_that_does_not_fit_stops_the_run_at_its_start(tmp_path):
    """training.init_from's drafter keeps its draft vocab and aux layer ids: a size or ids unlike the
    run's failed in build_vocab_mapping's or train_drafter's job, after generation (and extraction);
    now the run's start names the setting to change, for the run's training and a variant's."""
    from eagle3_pipeline import snakemake_adapter
    from eagle3_pipeline.conventions import default_aux_layer_ids
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.target_model import BUILTIN_CONFIG

    old = tmp_path / "old"
    old.mkdir()
    embedded = default_aux_layer_ids(BUILTIN_CONFIG["num_hidden_layers"])  # [2, 15, 27]
    (old / "config.json").write_text(json.dumps({"draft_vocab_size": 4096, "eagle_aux_hidden_state_layer_ids": embedded}))
    vocab = {"rule": "build_vocab_mapping", "stage": "build_vocab_mapping", "wildcards": {}}
    train = {"rule": "train_drafter", "stage": "train_drafter", "wildcards": {}}

    def why(jobs, **cfg):
        return snakemake_adapter.problem_at_start(jobs, validate_config(cfg), None)

    fits = {"training": {"init_from": str(old)}, "vocab": {"draft_vocab_size": 4096}}
    assert why([vocab, train], **fits) is None
    assert why([vocab, train], training={"init_from": str(old)}, vocab={"draft_vocab_size": 8192}) == (
        f"training.init_from={old} has a draft vocab of 4096, this run 8192: a warm start keeps its drafter's "
        "vocabulary; set vocab.draft_vocab_size: 4096"
    )
    other = fits | {"extraction": {"aux_layer_ids": [1, 2, 3]}}
    assert why([vocab], **other) is None  # the vocab job does not read aux ids
    assert why([train], **other) == (
        f"training.init_from={old} uses aux layer ids {embedded}, the drafter to train would use [1, 2, 3]; "
        f"set training.aux_layer_ids (or extraction.aux_layer_ids) to {embedded}"
    )
    assert why([train], **(other | {"training": {"init_from": str(old), "aux_layer_ids": embedded}})) is None
    # a variant's own warm start, checked by its own settings
    variant = {"rule": "train_drafter_variant", "stage": "train_drafter", "wildcards": {"variant": "w"}}
    sweep = {
        "sweep": {"variants": {"w": {"training": {"init_from": str(old), "aux_layer_ids": [2, 15]}, "vocab": {"draft_vocab_size": 4096}}}}
    }
    assert why([train], **sweep) is None
    assert why([train, variant], **sweep).startswith(f"sweep.variants.w.training.init_from={old} uses aux layer ids {embedded}")
    (old / "config.json").write_text("{")
    with pytest.raises(InputError, match=r"config.json"):
        why([train], **fits)


def test_an_empty_evaluation_prompt_file_stops_the_run_at_its_start(tmp_path):
    """An evaluation.prompts file with no question passed prepare_eval_prompts ("0 evaluation
    questions") and failed in evaluate_drafter, after generation, extraction and training, with an
    IndexError. load_eval_questions refuses it, and the run's start says so when a job that reads
    the questions is pending (prepare_prompts only when it decontaminates against them)."""
    from eagle3_pipeline import snakemake_adapter
    from eagle3_pipeline.io import InputError
    from eagle3_pipeline.prompts import load_eval_questions

    empty = tmp_path / "eval.jsonl"
    empty.write_text("\n \n")
    source = {"type": "file", "path": str(empty)}
    with pytest.raises(InputError, match=rf"^{re.escape(str(empty))}: no evaluation questions \(the file is empty"):
        load_eval_questions(source)
    jobs = {r: {"rule": r, "stage": r, "wildcards": {}} for r in ("prepare_eval_prompts", "prepare_prompts", "train_drafter")}

    def why(rules, **cfg):
        return snakemake_adapter.problem_at_start(
            [jobs[r] for r in rules], validate_config({"evaluation": {"prompts": source}, **cfg}), None
        )

    assert why(["prepare_eval_prompts", "prepare_prompts"]).startswith(f"{empty}: no evaluation questions")
    assert why(["prepare_prompts"]).startswith(f"{empty}: no evaluation questions")  # decontamination reads them
    assert why(["prepare_prompts"], prompts={"decontaminate": False}) is None
    assert why(["train_drafter"]) is None  # questions already prepared: not read again
    empty.write_text('{"turns": ["What is 2 + 2?"]}\n')
    assert why(["prepare_eval_prompts", "prepare_prompts"]) is None
    # a byte that is not UTF-8 (a file saved in Latin-1): the file, line and byte, not a UnicodeDecodeError
    empty.write_bytes(b'{"turns": ["What is 2 + 2?"]}\n{"turns": ["Caf\xe9 or tea?"]}\n')
    assert why(["prepare_eval_prompts"]) == f"{empty}:2: invalid UTF-8 (byte 0xe9 at column 16); re-encode the file as UTF-8"


def _engine(lengths, prompt_lens, slots, prog, clock, prefill_cost, decode_cost, budget=2048):
    """Drive ``prog`` as a vLLM engine with chunked prefill would: it holds up to ``slots``
    requests; each step spends its ``budget`` tokens on one token for every decoding request,
    then on prefill chunks of the others in order, and takes 0.02 s + ``prefill_cost`` per prompt
    token + ``decode_cost`` per decoded token of ``clock["now"]``. A request's prefill, when it
    ends, adds its prompt to ``clock["prompt"]`` and its first token to ``clock["generated"]``
    (as vLLM's counters do); it finishes at ``lengths[i]`` tokens."""
    waiting, active = list(zip(lengths, prompt_lens, strict=True)), []  # [length, prompt, prefill left, tokens]
    while waiting or active:
        while waiting and len(active) < slots:
            n, pl = waiting.pop(0)
            active.append([n, pl, pl, 0])
            prog.added(1, prompt_tokens=pl)
        prog.poll()
        yield
        decoding = [r for r in active if r[2] == 0]
        used, prefilled = len(decoding), 0
        for r in active:
            if r[2] and used < budget:
                chunk = min(r[2], budget - used)
                r[2], used, prefilled = r[2] - chunk, used + chunk, prefilled + chunk
                if not r[2]:
                    r[3], clock["generated"], clock["prompt"] = 1, clock["generated"] + 1, clock["prompt"] + r[1]
        for r in decoding:
            r[3] += 1
            clock["generated"] += 1
        clock["now"] += 0.02 + prefill_cost * prefilled + decode_cost * len(decoding)
        for r in [r for r in active if not r[2] and r[3] >= r[0]]:
            active.remove(r)
            prog.finished([r[0]])


@pytest.mark.parametrize("case", ["held_at_once", "streamed"])
@pytest.mark.parametrize("prefill_cost", [0.0017, 0.0003])  # per prompt token, against 0.0033 per decoded one: CPU-, GPU-like
def test_generations_progress_counts_tokens_so_its_eta_holds(monkeypatch, case, prefill_cost):
    """Answers decoded side by side end together, so finished prompts say little early on; the
    bar counts generated tokens against the answers' expected total. Its ETA prices the prompt
    tokens still to prefill and the completion tokens still to generate at costs fitted to the
    engine's counters: the demo's engine first prefills the 256 prompts it holds, making few
    completion tokens, and an ETA from their rate alone was 27x the real one there (1 h 39 min
    for 3 min 40 s); here it would be over 5x."""
    import numpy as np

    from eagle3_pipeline import generation

    monkeypatch.setattr(generation, "COUNTER_SECONDS", 0.0)
    rng = np.random.default_rng(0)
    if case == "held_at_once":  # the demo: 300 prompts, 256 in the engine, 2 in 3 answers cut at max_tokens
        prompts, slots, lengths = 300, 256, np.where(rng.random(300) < 2 / 3, 256, rng.integers(20, 256, 300))
    else:  # many prompts streamed through the engine
        prompts, slots, lengths = 2000, 64, rng.integers(20, 256, 2000)
    lengths, prompt_lens = [int(x) for x in lengths], [int(x) for x in rng.integers(50, 400, prompts)]
    clock = {"now": 0.0, "generated": 0, "prompt": 0}
    prog = generation.CompletionProgress(
        prompts, 1, 256, read_counters=lambda: (clock["prompt"], clock["generated"]), clock=lambda: clock["now"]
    )
    assert prog.bar.total == round(prompts * 0.79 * 256)  # before any answer: the plan's answer length
    assert prog.bar.format_dict["rate"] == 0 and "<?, ?tok/s" in prog.bar.format_meter(**prog.bar.format_dict)  # nothing read yet
    seen = []  # (seconds, bar total, ETA, completion tokens' rate alone) before each step
    for _ in _engine(lengths, prompt_lens, slots, prog, clock, prefill_cost, 0.0033):
        assert prog.bar.n == clock["generated"]
        (t0, _, g0), (t1, _, g1) = prog.reads[0], prog.reads[-1]
        alone = (prog.bar.total - prog.bar.n) / ((g1 - g0) / (t1 - t0)) if g1 > g0 else float("inf")
        seen.append((clock["now"], prog.bar.total, prog.eta_seconds(), alone))
        if prog.eta_seconds():  # the rate shown is the one the ETA implies
            assert prog.bar.format_dict["rate"] == pytest.approx((prog.bar.total - prog.bar.n) / prog.eta_seconds())
    end = clock["now"]
    prog.close(complete=True)
    assert prog.bar.n == prog.bar.total == sum(lengths) and prog.prompts_done == prompts
    assert prog.bar.format_dict["rate"] == pytest.approx(sum(lengths) / end)  # the last line: the run's mean rate
    early_alone = []
    for now, total, eta, alone in seen:
        if not 0.05 * end <= now <= 0.9 * end:
            continue
        eta, alone = eta / (end - now), alone / (end - now)  # over the real time left
        if case == "streamed":  # the lengths are learnt as answers end: the total and ETA hold
            assert 0.85 < eta < 1.15 and (now < 0.1 * end or 0.9 < total / sum(lengths) < 1.1), (now / end, eta, total / sum(lengths))
        else:  # the answers in flight are learnt only as they end, the prefill comes first, and the batch empties at the end
            assert 0.75 < total / sum(lengths) < 1.3 and 0.55 < eta < 1.5, (now / end, total / sum(lengths), eta)
            early_alone += [alone] if now < 0.3 * end else []
    if case == "held_at_once":
        assert max(early_alone) > 3  # what the completion tokens' rate alone said


def test_generations_progress_without_a_counter_and_with_rejected_prompts():
    from eagle3_pipeline.generation import CompletionProgress, engine_token_counters

    prog = CompletionProgress(10, 2, 100)  # the plan's answer: 79% of max_tokens
    assert prog.bar.total == 10 * 2 * 79
    prog.added(0, rejected=4)  # refused before the engine: done, and no longer in the total
    prog.update()
    assert prog.prompts_done == 4 and prog.bar.total == 6 * 2 * 79
    prog.added(6)
    prog.finished([50, 30])  # without a counter the bar moves as answers end
    prog.update()
    assert prog.bar.n == 80 and prog.prompts_done == 5 and prog.bar.postfix == "5/10 prompts, rate expected"
    # the 10 answers in flight hold g = 0 tokens so far: each is expected at the mean of the finished
    # answers longer than 0 (50 and 30) blended, as 8 answers, with 0 + 80 generated / 2 ended = 40
    assert prog.bar.total == round(80 + 10 * (80 + 8 * 40) / 10)
    prog.close(complete=False)  # a failed run keeps its estimate
    assert prog.bar.total == 480

    # with the engine's counter: the 10 answers in flight hold g = 60 tokens each so far and no finished
    # answer is longer: each is expected at 60 + min(100 - 60, 680 generated / 2 ended) = 100
    gen = {"n": 0}
    prog = CompletionProgress(6, 2, 100, read_counters=lambda: (0, gen["n"]))
    prog.added(6)
    prog.finished([50, 30])
    gen["n"] = 80 + 10 * 60
    prog.update()
    assert prog.bar.n == 680 and prog.bar.total == 80 + 10 * 100
    prog.finished([90, 100])  # two more ended: g = (680 - 270) / 8 = 51.25, and 90 and 100 are longer
    prog.update()
    each = (190 + 8 * (51.25 + min(100 - 51.25, 680 / 4))) / (2 + 8)
    assert prog.bar.total == round(270 + 8 * each)

    # the engine's counters, from what they held when the reader was made, in one read
    values = iter([(1000, 40), (1000, 40), (1250, 90)])
    calls = []

    def metrics():
        calls.append(1)
        g, p = next(values)
        return [SimpleNamespace(name="vllm:generation_tokens", value=g), SimpleNamespace(name="vllm:prompt_tokens", value=p)]

    read = engine_token_counters(SimpleNamespace(get_metrics=metrics))
    assert read() == (0, 0) and read() == (50, 250) and len(calls) == 3
    two = [SimpleNamespace(name=n, value=v) for n, v in (("vllm:prompt_tokens", 5), ("vllm:generation_tokens", 7))] * 2
    counts = iter([two, two + two])  # two engines' counters, then the same counted again: summed
    assert engine_token_counters(SimpleNamespace(get_metrics=lambda: next(counts)))() == (10, 14)

    def stats_off():
        raise AssertionError("Stat logging disabled")

    assert engine_token_counters(SimpleNamespace(get_metrics=stats_off)) is None
    assert engine_token_counters(SimpleNamespace()) is None  # an engine without metrics
    only_generated = [SimpleNamespace(name="vllm:generation_tokens", value=3)]  # another vLLM: no prompt counter
    assert engine_token_counters(SimpleNamespace(get_metrics=lambda: only_generated)) is None


def test_generations_eta_prices_prompt_and_completion_tokens_at_their_fitted_costs():
    """Reads whose seconds are 0.01 s per prompt token + 0.05 s per completion token exactly, with
    counts that are not proportional: the ETA is 0.01 x prompt tokens left (added, not yet
    prefilled, and the prompts not yet added at the mean so far) + 0.05 x completion tokens left.
    Proportional counts cannot tell the costs apart: one cost per token of either kind."""
    from eagle3_pipeline.generation import CompletionProgress

    now, counts = {"t": 0.0}, {"c": (0, 0)}
    prog = CompletionProgress(4, 1, 100, read_counters=lambda: counts["c"], clock=lambda: now["t"])
    prog.added(2, prompt_tokens=300)
    prog.update()
    assert prog.eta_seconds() is None and prog.bar.postfix == "0/4 prompts, prefill"  # nothing counted yet
    p = g = 0
    for dp, dg in ((50, 10), (0, 20), (100, 0), (20, 16)):
        p, g = p + dp, g + dg
        now["t"] += 0.01 * dp + 0.05 * dg
        counts["c"] = (p, g)
        prog.update()
    g_left = prog.bar.total - g
    assert prog.eta_seconds() == pytest.approx(0.01 * ((300 - 170) + 2 * 150) + 0.05 * g_left)
    assert prog.bar.format_dict["rate"] == pytest.approx(g_left / prog.eta_seconds())

    prog = CompletionProgress(4, 1, 100, read_counters=lambda: counts["c"], clock=lambda: now["t"])
    prog.added(2, prompt_tokens=300)
    p = g = 0
    for dt, dg in ((1.0, 10), (2.0, 20), (1.0, 10), (1.0, 10), (1.0, 10)):
        p, g = p + 2 * dg, g + dg
        now["t"] += dt
        counts["c"] = (p, g)
        prog.update()
    assert prog.eta_seconds() == pytest.approx(6.0 / (2 * 60 + 60) * ((300 - 120) + 2 * 150 + prog.bar.total - 60))

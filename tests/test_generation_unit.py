"""Prompt rendering, reasoning split, spec-decode counter parsing and decoding throughput (no engine needed)."""

from types import SimpleNamespace

import pytest

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

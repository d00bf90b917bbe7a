"""generate_traces: regenerate responses to prompts with the target under vLLM.

The prompt token ids are rendered here with the target's chat template and handed to
vLLM as token prompts, so the ids stored in a trace are exactly the ids the target
generated from; completion ids are vLLM's ``token_ids`` (including the end-of-turn
token when the target emitted one). Text is never re-tokenized downstream.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .io import InputError
from .prompts import Reject
from .runtime import progress

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"


def render_prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: Mapping | None = None) -> list[int]:
    """Token ids of ``messages`` under the target's chat template, with the generation prompt.

    transformers 5's ``apply_chat_template(tokenize=True)`` returns a ``BatchEncoding``
    (transformers 4 returned a list); both are handled explicitly.

    Returns:
        ``list[int]`` of prompt token ids.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if tokenizer.chat_template is None:
        raise ValueError("the target tokenizer has no chat template")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {}))
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], list):  # batched form of one conversation
        (ids,) = ids
    return [int(i) for i in ids]


def split_reasoning(text: str, start: str = THINK_START, end: str = THINK_END) -> tuple[str | None, str]:
    """Split a completion into ``(reasoning, answer)`` on think tags.

    * ``"<think>R</think>A"`` → ``("R", "A")``
    * ``"R</think>A"`` (the opening tag was in the prompt template) → ``("R", "A")``
    * ``"<think>R"`` (truncated inside reasoning) → ``("R", "")``
    * no tags → ``(None, text)``

    Leading/trailing whitespace around the parts is stripped from the answer only.
    """
    if start in text:
        before, _, rest = text.partition(start)
        if end in rest:
            reasoning, _, answer = rest.partition(end)
            return reasoning, (before + answer).strip()
        return rest, before.strip()
    if end in text:
        reasoning, _, answer = text.partition(end)
        return reasoning, answer.strip()
    return None, text


def make_reasoning_splitter(gen_cfg: dict, tokenizer):
    """A function ``text -> (reasoning | None, answer)`` for the configured reasoning format.

    With ``gen_cfg["reasoning_parser"]`` set, vLLM's parser of that name
    (``ReasoningParserManager``) does the split, as vLLM's server would; otherwise
    :func:`split_reasoning` on the configured tags.

    Raises:
        ValueError: the parser name is unknown to vLLM, or the parser rejects the
            tokenizer (e.g. its think tokens are not in the vocabulary).
    """
    name = gen_cfg.get("reasoning_parser")
    if not name:
        start, end = gen_cfg["reasoning_start"], gen_cfg["reasoning_end"]
        return lambda text: split_reasoning(text, start, end)
    from vllm.reasoning import ReasoningParserManager

    try:
        parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    except KeyError as e:
        raise ValueError(f"generation.reasoning_parser={name!r} is not a vLLM reasoning parser") from e
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"generation.reasoning_parser={name!r} does not fit the target tokenizer: {e}") from e

    def split(text: str) -> tuple[str | None, str]:
        reasoning, content = parser.extract_reasoning(text, None)
        return reasoning, content or ""

    return split


@dataclass
class ShardResult:
    """Traces, rejects and counts of one generated shard."""

    traces: list[dict] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        c = self.counts
        return {
            "prompts": c["prompts"],
            "ok": c["ok"],
            "errored": c["errored"],
            "truncated": c["truncated"],
            "rejected": len(self.rejects),
            "rejects_by_reason": dict(sorted(Counter(r.reason for r in self.rejects).items())),
            "reasoning_captured": c["reasoning"],
            "reasoning_capture_rate": (c["reasoning"] / c["ok"]) if c["ok"] else 0.0,
            "prompt_tokens": c["prompt_tokens"],
            "completion_tokens": c["completion_tokens"],
        }


def generate_shard(
    llm,
    tokenizer,
    records: Sequence[dict],
    gen_cfg: dict,
    *,
    max_seq_len: int,
    seed: int,
    engine: dict,
    model: dict,
    chunk_size: int = 1024,
) -> ShardResult:
    """Generate one completion per prompt record with ``llm`` (a ``vllm.LLM``).

    Prompts whose rendered length leaves no room for a completion within
    ``max_seq_len`` tokens are rejected (``prompt_too_long``); each request's
    ``max_tokens`` is ``min(gen_cfg["max_tokens"], max_seq_len - prompt_tokens)``, so
    prompt + completion never exceeds ``max_seq_len`` (the same limit extraction and
    training use). Outputs keep the input (prompt-id) order.

    Args:
        llm: a ``vllm.LLM``.
        tokenizer: the target tokenizer (chat template).
        records: canonical prompt records (``id``, ``messages``, ``source``).
        gen_cfg: validated ``generation:`` config (sampling params, reasoning tags).
        max_seq_len: context limit in tokens.
        seed: engine seed recorded in each trace.
        engine: :func:`eagle3_pipeline.engine.engine_identity` output.
        model: ``{"path", "fingerprint"}`` of the target.
        chunk_size: prompts per ``llm.generate`` call (progress granularity).

    Raises:
        InputError: every prompt of the shard was rejected (nothing to train on).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    res = ShardResult()
    sampling = {k: gen_cfg[k] for k in ("temperature", "top_p", "top_k", "max_tokens")}
    split = make_reasoning_splitter(gen_cfg, tokenizer)
    min_completion = gen_cfg["min_completion_tokens"]
    todo = []
    for rec in records:
        res.counts["prompts"] += 1
        try:
            ids = render_prompt_ids(tokenizer, rec["messages"], gen_cfg.get("chat_template_kwargs"))
        except Exception as e:  # a template that raises on this conversation
            res.rejects.append(Reject(rec["source"], "template_error", f"{type(e).__name__}: {e}", id=rec["id"]))
            continue
        room = max_seq_len - len(ids)
        if room < min_completion:
            res.rejects.append(
                Reject(
                    rec["source"],
                    "prompt_too_long",
                    f"{len(ids)} prompt tokens leave {room} < {min_completion} completion tokens within max_seq_len={max_seq_len}",
                    id=rec["id"],
                )
            )
            continue
        todo.append((rec, ids, min(sampling["max_tokens"], room)))

    bar = progress(total=len(todo), desc="generate", unit="prompt")
    for start in range(0, len(todo), chunk_size):
        chunk = todo[start : start + chunk_size]
        prompts = [TokensPrompt(prompt_token_ids=ids) for _, ids, _ in chunk]
        params = [
            SamplingParams(
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=sampling["top_k"],
                max_tokens=mt,
                skip_special_tokens=gen_cfg["skip_special_tokens"],
            )
            for _, _, mt in chunk
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for (rec, ids, mt), out in zip(chunk, outputs, strict=True):
            comp = out.outputs[0] if out.outputs else None
            if comp is None or comp.finish_reason not in ("stop", "length"):
                res.counts["errored"] += 1
                reason = comp.finish_reason if comp is not None else "no_output"
                res.rejects.append(Reject(rec["source"], "generation_error", f"finish_reason={reason}", id=rec["id"]))
                continue
            comp_ids = [int(t) for t in comp.token_ids]
            if not comp_ids:
                res.rejects.append(Reject(rec["source"], "empty_completion", "the target produced no tokens", id=rec["id"]))
                continue
            if list(out.prompt_token_ids) != ids:
                raise RuntimeError(f"vLLM changed the prompt ids of {rec['id']}: tokenization drift")
            reasoning, answer = split(comp.text)
            res.counts["ok"] += 1
            res.counts["truncated"] += comp.finish_reason == "length"
            res.counts["reasoning"] += reasoning is not None
            res.counts["prompt_tokens"] += len(ids)
            res.counts["completion_tokens"] += len(comp_ids)
            res.traces.append(
                {
                    "id": rec["id"],
                    "source": rec["source"],
                    "messages": rec["messages"],
                    "prompt_token_ids": ids,
                    "completion_token_ids": comp_ids,
                    "text": comp.text,
                    "reasoning": reasoning,
                    "content": answer,
                    "finish_reason": comp.finish_reason,
                    "sampling": {**sampling, "max_tokens": mt, "seed": seed},
                    "engine": engine,
                    "model": model,
                }
            )
        bar.update(len(chunk))
    bar.close()
    if records and not res.traces:
        for r in res.rejects[:20]:
            logger.error("rejected %s (%s): %s %s", r.id, r.source, r.reason, r.detail)
        raise InputError(
            f"no usable traces: all {len(records)} prompts of this shard were rejected {res.summary()['rejects_by_reason']}; "
            "the first rejects are listed above in this log"
        )
    return res

"""generate_traces: regenerate responses to prompts with the target under vLLM.

The prompt token ids are rendered here with the target's chat template and handed to
vLLM as token prompts, so the ids stored in a trace are exactly the ids the target
generated from; completion ids are vLLM's ``token_ids`` (including the end-of-turn
token when the target emitted one). Text is never re-tokenized downstream.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .conventions import answer_id, prompt_of, repetition_loop
from .io import InputError, sha256_json
from .layout import pids_of, summary_beside
from .plan import COMPLETION_FILL
from .prompts import Reject, edited_prompts
from .runtime import Timer, progress, rate

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


#: gpt-oss's harmony format: a completion is messages ``<|channel|>NAME<|message|>CONTENT``, each
#: ended by ``<|end|>`` (``<|return|>``, ``<|call|>`` at the last) and the next opened by
#: ``<|start|>assistant`` (OpenAI's harmony response format).
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
#: vLLM's name of gpt-oss's reasoning parser, which finds boundaries only (vLLM parses such output
#: with the openai_harmony package): the split is :func:`harmony_splitter`'s.
HARMONY_PARSER = "openai_gptoss"


def harmony_token_ids(tokenizer) -> dict[str, int] | None:
    """The ids of :data:`HARMONY_TOKENS` when each is one token of ``tokenizer`` (a harmony tokenizer
    such as gpt-oss's o200k_harmony), else None."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in HARMONY_TOKENS}
    unk = getattr(tokenizer, "unk_token_id", None)
    return ids if all(isinstance(i, int) and i != unk for i in ids.values()) else None


def harmony_splitter(tokenizer, ids: dict[str, int]):
    """``(text, token_ids) -> (reasoning | None, answer)`` for harmony completions: the decoded
    contents of the ``analysis`` channel's messages (None when there is none) and of the ``final``
    channel's (the whole decoded completion when it has no channel at all, e.g. cut before one)."""
    opener, channel, message = ids["<|start|>"], ids["<|channel|>"], ids["<|message|>"]
    closers = {ids["<|end|>"], ids["<|return|>"], ids["<|call|>"], opener}

    def split(text: str, token_ids: Sequence[int]) -> tuple[str | None, str]:
        parts: dict[str, list[int]] = {}
        i, n = 0, len(token_ids)
        while i < n:
            if token_ids[i] != channel:
                i += 1
                continue
            j = i + 1
            while j < n and token_ids[j] != message:
                j += 1
            name = tokenizer.decode(list(token_ids[i + 1 : j])).strip()
            k = j + 1
            while k < n and token_ids[k] not in closers:
                k += 1
            parts.setdefault(name, []).extend(token_ids[j + 1 : k])
            i = k
        if not parts:
            return None, text
        reasoning = tokenizer.decode(parts["analysis"]) if "analysis" in parts else None
        return reasoning, tokenizer.decode(parts.get("final", [])).strip()

    return split


def make_reasoning_splitter(gen_cfg: dict, tokenizer):
    """A function ``(text, completion token ids) -> (reasoning | None, answer)`` for the configured
    reasoning format.

    With ``gen_cfg["reasoning_parser"]`` set, vLLM's parser of that name
    (``ReasoningParserManager``) does the split, as vLLM's server would; gpt-oss's
    (:data:`HARMONY_PARSER`), and a harmony tokenizer without a parser, split by
    :func:`harmony_splitter`; otherwise :func:`split_reasoning` on the configured tags.

    Raises:
        ValueError: the parser name is unknown to vLLM, or the parser rejects the
            tokenizer (e.g. its think tokens are not in the vocabulary, or a harmony parser
            for a tokenizer without the harmony tokens).
    """
    name = gen_cfg.get("reasoning_parser")
    harmony = harmony_token_ids(tokenizer) if name in (None, "", HARMONY_PARSER) else None
    if name == HARMONY_PARSER and harmony is None:
        raise ValueError(
            f"generation.reasoning_parser={name!r} does not fit the target tokenizer: it has no harmony tokens {HARMONY_TOKENS}"
        )
    if harmony is not None:
        return harmony_splitter(tokenizer, harmony)
    if not name:
        start, end = gen_cfg["reasoning_start"], gen_cfg["reasoning_end"]
        return lambda text, token_ids=(): split_reasoning(text, start, end)
    from vllm.reasoning import ReasoningParserManager

    try:
        parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    except KeyError as e:
        raise ValueError(f"generation.reasoning_parser={name!r} is not a vLLM reasoning parser") from e
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"generation.reasoning_parser={name!r} does not fit the target tokenizer: {e}") from e

    def split(text: str, token_ids: Sequence[int] = ()) -> tuple[str | None, str]:
        reasoning, content = parser.extract_reasoning(text, None)
        return reasoning, content or ""

    return split


@dataclass
class ShardResult:
    """Traces and rejects of generated prompts; every count derives from them."""

    traces: list[dict] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)

    def summary(self) -> dict:
        """Counts: prompts (distinct prompt ids), ok (traces: answers), errored, truncated (at
        ``max_tokens``), repetition_loops (answers ending in one, :func:`eagle3_pipeline.conventions.repetition_loop`), rejects
        by reason, reasoning capture, tokens."""
        ok = len(self.traces)
        reasoning = sum(t["reasoning"] is not None for t in self.traces)
        by_reason = Counter(r.reason for r in self.rejects)
        prompts = {prompt_of(t["id"]) for t in self.traces} | {prompt_of(r.id or r.source) for r in self.rejects}
        return {
            "prompts": len(prompts),
            "ok": ok,
            "errored": by_reason["generation_error"],
            "truncated": sum(t["finish_reason"] == "length" for t in self.traces),
            "repetition_loops": sum(repetition_loop(t["completion_token_ids"]) is not None for t in self.traces),
            "rejected": len(self.rejects),
            "rejects_by_reason": dict(sorted(by_reason.items())),
            "reasoning_captured": reasoning,
            "reasoning_capture_rate": reasoning / ok if ok else 0.0,
            "prompt_tokens": sum(len(t["prompt_token_ids"]) for t in self.traces),
            "completion_tokens": sum(len(t["completion_token_ids"]) for t in self.traces),
        }

    def check_usable(self) -> None:
        """Raise when prompts were given but none produced a trace (nothing to train on).

        Raises:
            InputError: naming the reject counts; the first rejects go to the log.
        """
        if self.rejects and not self.traces:
            for r in self.rejects[:20]:
                logger.error("rejected %s (%s): %s %s", r.id, r.source, r.reason, r.detail)
            by_reason = self.summary()["rejects_by_reason"]
            hint = (
                "raise max_seq_len (or lower generation.min_completion_tokens) so that the prompts fit; "
                if "prompt_too_long" in by_reason
                else ""
            )
            raise InputError(
                f"no usable traces: all {len(self.rejects)} prompts of this shard were rejected {by_reason}; "
                f"the first rejects are listed above in this log. A rerun rejects them again: {hint}"
                "or lower prompts.num_shards, so that every shard holds prompts that give traces, "
                "or remove these prompts from the sources"
            )


#: The keys of a trace record's ``sampling`` that are its request's, not the run's: ``max_tokens``
#: (``generation.max_tokens``, lowered to the room its prompt leaves in ``max_seq_len``) and
#: ``request_seed`` (sampled decoding's per-prompt seed); the other keys are the same for every
#: record of a run (the manifest checks them across shards).
REQUEST_SAMPLING_KEYS = ("max_tokens", "request_seed")

#: A generation engine is kept fed with this many unfinished requests per running sequence
#: slot (``max_num_seqs``): the next chunk's requests are added while fewer are unfinished, so
#: the batch never drains between chunks.
QUEUE_FACTOR = 2


def _requests(
    tokenizer, records: Sequence[dict], gen_cfg: dict, max_seq_len: int
) -> tuple[list[tuple[dict, list[int], int]], list[Reject]]:
    """Render ``records`` and split them into requests ``(record, prompt ids, max_tokens)`` and rejects.

    A prompt whose rendered length leaves fewer than ``min_completion_tokens`` within
    ``max_seq_len`` is rejected (``prompt_too_long``), one whose template raises is rejected
    (``template_error``); a request's ``max_tokens`` is ``min(max_tokens, max_seq_len - prompt
    tokens)``.
    """
    todo, rejects = [], []
    min_completion = gen_cfg["min_completion_tokens"]
    for rec in records:
        try:
            ids = render_prompt_ids(tokenizer, rec["messages"], gen_cfg.get("chat_template_kwargs"))
        except Exception as e:  # a template that raises on this conversation
            rejects.append(Reject(rec["source"], "template_error", f"{type(e).__name__}: {e}", id=rec["id"]))
            continue
        room = max_seq_len - len(ids)
        if room < min_completion:
            rejects.append(
                Reject(
                    rec["source"],
                    "prompt_too_long",
                    f"{len(ids)} prompt tokens leave {room} < {min_completion} completion tokens within max_seq_len={max_seq_len}",
                    id=rec["id"],
                )
            )
            continue
        todo.append((rec, ids, min(gen_cfg["max_tokens"], room)))
    return todo, rejects


#: The trace shard's summary keys of the shard's SHA-256 and :func:`eagle3_pipeline.io.file_stat`.
SUMMARY_HASH_KEYS = ("traces_sha256", "traces_stat")


def traces_summary_path(traces_path: str | os.PathLike) -> Path:
    """The ``.summary.json`` a trace shard's job writes beside it (counts, ``traces_sha256``)."""
    return summary_beside(traces_path)


def recorded_traces_sha256(traces_path: str | os.PathLike) -> str:
    """The SHA-256 of a trace shard, checked against the one generation recorded in its summary
    (:func:`eagle3_pipeline.io.checked_sha256`); hashed without a check when there is no summary
    (traces brought from another machine: docs/interrupted-runs.md "Traces from another machine").

    Raises:
        InputError: the shard's bytes differ from the recorded ones.
    """
    from .io import recorded_sha256

    return recorded_sha256(traces_path, traces_summary_path(traces_path), *SUMMARY_HASH_KEYS)


def queued_requests(llm) -> int:
    """Unfinished requests to keep in ``llm``'s engine: :data:`QUEUE_FACTOR` x its ``max_num_seqs`` (512 if unknown)."""
    try:
        return QUEUE_FACTOR * int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    except (AttributeError, TypeError, ValueError):
        return 512


#: Seconds between two reads of the engine's generated-token counter (a read took 7-23 ms on
#: 2 CPU cores with the embedded target).
COUNTER_SECONDS = 2.0
#: Weight, in answers, of the prior answer length against the mean of the answers finished so far.
PRIOR_ANSWERS = 8
#: Seconds of counter reads generation's bar takes its rate (and ETA) over.
RATE_WINDOW_SECONDS = 30.0


#: vLLM's counters a bar reads: prompt tokens prefilled (counted when a request's prefill ends)
#: and completion tokens generated.
TOKEN_COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens")


def engine_token_counters(llm) -> Callable[[], tuple[int, int]] | None:
    """A function returning ``(prompt tokens prefilled, completion tokens generated)`` by
    ``llm``'s engine since this call.

    Reads vLLM's :data:`TOKEN_COUNTERS` (``vllm.LLM.get_metrics``, its Prometheus metrics, which
    :func:`eagle3_pipeline.engine.build_llm` keeps on) in one call. The counters are the
    process's, so what they held at this call is subtracted.

    Returns:
        The reader, or None where this engine reports no such counters (stats off, another vLLM).
    """

    def read() -> tuple[int, int] | None:
        got: dict[str, int] = {}
        try:
            for m in llm.get_metrics():  # one entry per engine of the LLM: summed
                if m.name in TOKEN_COUNTERS:
                    got[m.name] = got.get(m.name, 0) + int(m.value)
        except (AssertionError, AttributeError, TypeError, ValueError):  # stats off: vLLM asserts
            return None
        return (got[TOKEN_COUNTERS[0]], got[TOKEN_COUNTERS[1]]) if len(got) == len(TOKEN_COUNTERS) else None

    base = read()
    if base is None:
        return None

    def since() -> tuple[int, int]:
        now = read() or base
        return now[0] - base[0], now[1] - base[1]

    return since


class CompletionProgress:
    """Generation's progress bar, in completion tokens, so that its rate and ETA hold from the start.

    An engine decodes all its requests side by side, so a bar over finished prompts stands near
    0 until the first answers end (its first ETA was 10x the real one on the demo). This bar
    counts the tokens the engine has generated (``read_counters``, e.g.
    :func:`engine_token_counters`; without it, the tokens of finished answers), and its total
    is the tokens all answers are expected to end with, re-estimated at most every
    :data:`COUNTER_SECONDS` s:

    * a finished answer: its length;
    * an answer in flight: with g the tokens the answers in flight hold on average so far, the
      mean length of the finished answers longer than g (the finished ones are the short ones;
      those in flight are known to be longer than g), blended, weighted as
      :data:`PRIOR_ANSWERS` answers, with g plus what is left if answers go on ending at the
      rate they have (one per generated tokens / answers ended; up to ``max_tokens``, which is
      all that is known before the first answer ends);
    * an answer not yet started: the mean of the two above, blended likewise with the plan's
      answer length (:data:`eagle3_pipeline.plan.COMPLETION_FILL` x ``max_tokens``), which is
      also the whole estimate before any answer started.

    On simulated engines (``tests/test_generation_unit.py``) the total is within 10% of the
    final one from a tenth of the run on when the engine holds a small part of the prompts at a
    time, and within 35% when it holds them all at once, as in the demo (it learns the lengths
    only as answers end). Prompts done (answered or rejected) are in its postfix.

    Its ETA is the time the engine's work left takes at the costs seen over the last
    :data:`RATE_WINDOW_SECONDS` of counter reads (:meth:`eta_seconds`): prompt tokens to
    prefill and completion tokens to generate, each at its own cost where the reads tell them
    apart (a least-squares fit of each read's seconds to both counts), at one cost per token of
    either where they do not. The prefill of the prompts an engine takes at once makes few
    completion tokens: the demo's first ETA from the completion tokens' rate alone was 30 min,
    then 1 h 39 min, for 3 min 40 s left. The rate shown is the one that ETA implies, the completion
    tokens/s expected over the rest (the postfix says ``rate expected``): early on it is well above
    the tokens shown over the time elapsed, which went mostly into prefill; "?" before a read has
    counted a token (the postfix says ``prefill``).

    Args:
        prompts: prompts this bar counts to.
        answers_per_prompt: answers requested per prompt.
        max_tokens: completion tokens an answer may have (``generation.max_tokens``, at most ``max_seq_len``).
        read_counters: ``(prompt tokens prefilled, completion tokens generated)`` so far
            (:func:`engine_token_counters`), or None.
        clock: seconds (``time.monotonic``; a test passes its own).
        desc: the bar's label.
    """

    def __init__(
        self,
        prompts: int,
        answers_per_prompt: int,
        max_tokens: int,
        read_counters: Callable[[], tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        desc: str = "generate",
    ) -> None:
        import numpy as np

        self.prompts, self.answers_per_prompt, self.max_tokens = prompts, answers_per_prompt, int(max_tokens)
        self.prior = COMPLETION_FILL * self.max_tokens
        self.read_counters, self.clock = read_counters, clock
        self.answers_left = prompts * answers_per_prompt  # answers not yet added to the engine
        self.in_flight = 0  # answers added, not finished
        self.lengths = np.zeros(self.max_tokens + 1, dtype=np.int64)  # finished answers by length
        self.done_answers = self.done_tokens = self.prompts_done = self.generated = 0
        self.prompts_added = self.prompt_tokens_added = self.prefilled = 0
        self.last_update, self.started = -float("inf"), clock()
        self.reads: deque[tuple[float, int, int]] = deque()  # (clock, prefilled, generated) of recent updates
        self.bar = progress(total=self.expected_total(), desc=desc, unit="tok", unit_scale=True, rate_source=self.rate)

    def expected_total(self) -> int:
        """Completion tokens all answers are expected to end with (at least those generated)."""
        import numpy as np

        k = PRIOR_ANSWERS
        in_flight = 0.0
        if self.in_flight:
            g = max(self.generated - self.done_tokens, 0) / self.in_flight
            longer = self.lengths[min(int(g) + 1, self.max_tokens + 1) :]
            n_longer = int(longer.sum())
            sum_longer = float(longer @ np.arange(self.max_tokens + 1 - len(longer), self.max_tokens + 1))
            # what an answer holding g tokens has left if answers go on ending at the rate they did:
            # one per (tokens generated / answers ended), capped by max_tokens
            left = self.max_tokens - g
            if self.done_answers:
                left = min(left, self.generated / self.done_answers)
            each = (sum_longer + k * (g + left)) / (n_longer + k)
            in_flight = self.in_flight * max(each, g)
        mean = (self.done_tokens + in_flight + k * self.prior) / (self.done_answers + self.in_flight + k)
        return max(round(self.done_tokens + in_flight + self.answers_left * mean), self.generated, 1)

    def eta_seconds(self) -> float | None:
        """Seconds the engine's work left takes at the costs of the recent reads, or None before
        a read counted a generated token.

        Work left: the completion tokens the bar still expects and the prompt tokens not yet
        prefilled (those of prompts not yet added at the mean so far). With ``dt``, ``dp``,
        ``dg`` each read's seconds, prompt tokens and completion tokens since the one before,
        ``dt ~ a dp + b dg`` is fitted by least squares; where the reads tell ``a`` and ``b``
        apart (their counts not proportional, each cost positive and known to within a quarter
        of itself: vLLM counts a prompt when its prefill ends, so the counts come in lumps), ETA
        = a x prompt tokens left + b x completion tokens left, else one cost per token of either
        kind, sum(dt) / sum(dp + dg). Without the prompt counter: completion tokens left / their rate.
        """
        if len(self.reads) < 2 or self.reads[-1][2] == 0:
            return None
        steps = [(t1 - t0, p1 - p0, g1 - g0) for (t0, p0, g0), (t1, p1, g1) in itertools.pairwise(self.reads)]
        dt, dp, dg = (sum(x) for x in zip(*steps, strict=True))
        if dt <= 0 or dg <= 0:
            return None
        g_left = max(self.bar.total - self.generated, 0)
        if self.read_counters is None or self.prompts_added == 0:
            return g_left * dt / dg
        prompts_left = self.answers_left / self.answers_per_prompt
        p_left = max(self.prompt_tokens_added - self.prefilled, 0) + prompts_left * self.prompt_tokens_added / self.prompts_added
        if len(steps) > 3:
            counts = np.array([(p, g) for _, p, g in steps], dtype=float)  # [reads, 2]
            gram = counts.T @ counts
            if np.linalg.det(gram) > 0.05 * gram[0, 0] * gram[1, 1]:  # the counts are not (nearly) proportional
                (a, b), residual, _, _ = np.linalg.lstsq(counts, np.array([t for t, _, _ in steps]), rcond=None)
                var = residual[0] / (len(steps) - 2)  # of a read's seconds
                se2 = var * np.diag(np.linalg.inv(gram))  # the costs' squared standard errors
                # both costs known to within a quarter of themselves, else one cost
                if a > 0 and b > 0 and se2[0] < (a / 4) ** 2 and se2[1] < (b / 4) ** 2:
                    return float(a * p_left + b * g_left)
        return dt / (dp + dg) * (p_left + g_left)

    def rate(self) -> float | None:
        """The completion tokens/s :meth:`eta_seconds` implies (what the bar shows, and tqdm takes
        its ETA from), None before it is known."""
        eta = self.eta_seconds()
        return (self.bar.total - self.bar.n) / eta if eta else None

    def added(self, prompts: int, rejected: int = 0, prompt_tokens: int = 0) -> None:
        """``prompts`` prompts of ``prompt_tokens`` tokens in all went to the engine and
        ``rejected`` were refused before it."""
        self.answers_left -= (prompts + rejected) * self.answers_per_prompt
        self.in_flight += prompts * self.answers_per_prompt
        self.prompts_done += rejected
        self.prompts_added += prompts
        self.prompt_tokens_added += prompt_tokens

    def finished(self, lengths: Sequence[int]) -> None:
        """One prompt's answers ended, of ``lengths`` completion tokens each."""
        for n in lengths:
            self.lengths[min(int(n), self.max_tokens)] += 1
        self.in_flight -= self.answers_per_prompt  # the request ended, whatever it returned
        self.done_answers += len(lengths)
        self.done_tokens += int(sum(lengths))
        self.prompts_done += 1
        self.generated = max(self.generated, self.done_tokens)

    def poll(self) -> None:
        """Before an engine step: when :data:`COUNTER_SECONDS` have passed, read the generated
        tokens and re-estimate the total."""
        now = self.clock()
        if now - self.last_update >= COUNTER_SECONDS:
            self.last_update = now
            self.update()

    def update(self) -> None:
        """Read the generated tokens and re-estimate the total now."""
        if self.read_counters is not None:
            prefilled, generated = self.read_counters()
            self.prefilled = max(self.prefilled, prefilled)
            self.generated = max(self.generated, generated, self.done_tokens)
        now = self.clock()
        self.reads.append((now, self.prefilled, self.generated))
        while len(self.reads) > 2 and self.reads[1][0] <= now - RATE_WINDOW_SECONDS:
            self.reads.popleft()
        self.bar.total = self.expected_total()
        state = ", prefill" if self.generated == 0 and self.in_flight else ", rate expected"
        self.bar.set_postfix_str(f"{self.prompts_done}/{self.prompts} prompts{state}", refresh=False)
        self.bar.update(self.generated - self.bar.n)

    def close(self, complete: bool) -> None:
        """End the bar; ``complete``: every answer finished, so the total is what was generated."""
        self.update()
        if complete:
            self.bar.total = self.bar.n
        elapsed = self.clock() - self.started
        mean = self.generated / elapsed if elapsed > 0 else None
        self.bar.rate_source = lambda: mean  # the last line shows the whole run's rate, not the ETA's
        self.bar.close()


def generate_chunks(
    llm,
    tokenizer,
    records: Sequence[dict],
    ranges: Sequence[tuple[int, int]],
    chunks,
    gen_cfg: dict,
    *,
    max_seq_len: int,
    seed: int,
    engine: dict,
    model: dict,
    on_chunk,
    total: int | None = None,
) -> None:
    """Generate ``answers_per_prompt`` completions per prompt record of each chunk, feeding the engine continuously.

    Chunk ``i`` is ``records[ranges[i][0]:ranges[i][1]]``; chunk indices are taken from the
    iterable ``chunks`` (a shared queue with data-parallel replicas) whenever fewer than
    :func:`queued_requests` requests are unfinished, so the running batch stays full across
    chunk boundaries (``vllm.LLM.generate`` per chunk would drain it at every chunk's end).
    When the last request of a chunk finishes, ``on_chunk(i, ShardResult)`` is called with the
    chunk's traces in input (prompt-id) order and its rejects; chunks complete roughly in the
    order they were taken. The engine is driven as ``LLM.generate`` drives it
    (``RequestOutputKind.FINAL_ONLY`` requests, :func:`eagle3_pipeline.engine.feed_engine`).

    Args:
        llm: a ``vllm.LLM``.
        tokenizer: the target tokenizer (chat template).
        records: canonical prompt records (``id``, ``messages``, ``source``).
        ranges: ``(start, end)`` record indices of each chunk.
        chunks: iterable of chunk indices to generate.
        gen_cfg: validated ``generation:`` config (sampling params, reasoning tags).
        max_seq_len: context limit in tokens (prompt + completion).
        seed: engine seed recorded in each trace.
        engine: :func:`eagle3_pipeline.engine.engine_identity` output.
        model: ``{"path", "fingerprint"}`` of the target.
        on_chunk: called as ``on_chunk(i, result)`` once per finished chunk.
        total: prompts the progress bar counts to (default: every record).

    Raises:
        RuntimeError: vLLM returned other prompt ids than it was given (tokenization drift).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from .engine import feed_engine

    sampling = {k: gen_cfg[k] for k in ("temperature", "top_p", "top_k", "max_tokens")}
    answers = gen_cfg["answers_per_prompt"]

    def request_seed(prompt: str) -> dict:
        """Sampling's per-request seed, from the run's seed and the prompt id: a prompt's answers do
        not depend on which chunk, replica or batch it ran in (greedy decoding needs none)."""
        if gen_cfg["temperature"] == 0:
            return {}
        return {"request_seed": int(sha256_json([seed, prompt])[:8], 16)}

    split = make_reasoning_splitter(gen_cfg, tokenizer)
    eng = llm.llm_engine
    # chunk index -> [requests, finished outputs by position, rejects]
    open_chunks: dict[int, tuple[list, dict, list]] = {}
    # no request asks for more than its prompt leaves within max_seq_len (``_requests``), whatever max_tokens says
    ceiling = min(gen_cfg["max_tokens"], max_seq_len)
    bar = CompletionProgress(len(records) if total is None else total, answers, ceiling, engine_token_counters(llm))

    def finish(i: int) -> None:
        todo, outs, rejects = open_chunks.pop(i)
        res = ShardResult(rejects=list(rejects))
        for k, (rec, ids, mt) in enumerate(todo):
            out = outs[k]
            if list(out.prompt_token_ids) != ids:
                raise RuntimeError(f"vLLM changed the prompt ids of {rec['id']}: tokenization drift")
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != answers:
                res.rejects.append(Reject(rec["source"], "generation_error", f"{len(comps)} of {answers} answers returned", id=rec["id"]))
                continue
            seen: dict[tuple[int, ...], str] = {}
            for j, comp in enumerate(comps):
                aid = answer_id(rec["id"], j)
                if comp.finish_reason not in ("stop", "length"):
                    res.rejects.append(Reject(rec["source"], "generation_error", f"finish_reason={comp.finish_reason}", id=aid))
                    continue
                comp_ids = [int(t) for t in comp.token_ids]
                if not comp_ids:
                    res.rejects.append(Reject(rec["source"], "empty_completion", "the target produced no tokens", id=aid))
                    continue
                if tuple(comp_ids) in seen:
                    res.rejects.append(
                        Reject(rec["source"], "duplicate_answer", f"the same tokens as answer {seen[tuple(comp_ids)]}", id=aid)
                    )
                    continue
                seen[tuple(comp_ids)] = aid
                reasoning, answer = split(comp.text, comp_ids)
                res.traces.append(
                    {
                        "id": aid,
                        "source": rec["source"],
                        "messages": rec["messages"],
                        "prompt_token_ids": ids,
                        "completion_token_ids": comp_ids,
                        "text": comp.text,
                        "reasoning": reasoning,
                        "content": answer,
                        "finish_reason": comp.finish_reason,
                        "sampling": {**sampling, "max_tokens": mt, "seed": seed, **request_seed(rec["id"])},
                        "engine": engine,
                        "model": model,
                    }
                )
        on_chunk(i, res)

    def add_chunk(i: int) -> None:
        a, b = ranges[i]
        todo, rejects = _requests(tokenizer, records[a:b], gen_cfg, max_seq_len)
        open_chunks[i] = (todo, {}, rejects)
        bar.added(len(todo), rejected=len(rejects), prompt_tokens=sum(len(ids) for _, ids, _ in todo))
        for k, (rec, ids, mt) in enumerate(todo):
            params = SamplingParams(
                n=answers,
                seed=request_seed(rec["id"]).get("request_seed"),
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=sampling["top_k"],
                max_tokens=mt,
                skip_special_tokens=gen_cfg["skip_special_tokens"],
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            eng.add_request(f"{i}-{k}", TokensPrompt(prompt_token_ids=ids), params)
        if not todo:
            finish(i)

    def on_finished(out) -> None:
        i, k = map(int, out.request_id.split("-"))
        outs = open_chunks[i][1]
        outs[k] = out
        bar.finished([len(c.token_ids) for c in out.outputs])
        if len(outs) == len(open_chunks[i][0]):
            finish(i)

    complete = False
    try:
        feed_engine(eng, chunks, add_chunk, on_finished, queued=queued_requests(llm), poll=bar.poll)
        complete = not open_chunks
    finally:
        bar.close(complete)
    if open_chunks:  # the engine has no request left for them: a bug, never a silent loss
        raise RuntimeError(f"generation: chunks {sorted(open_chunks)} have requests that never finished")


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
    require_traces: bool = True,
) -> ShardResult:
    """Generate one completion per prompt record with ``llm`` (a ``vllm.LLM``): one chunk of :func:`generate_chunks`.

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
        require_traces: raise when every prompt was rejected (see ``ShardResult.check_usable``).

    Raises:
        InputError: every prompt of the shard was rejected (nothing to train on).
    """
    results: list[ShardResult] = []
    generate_chunks(
        llm,
        tokenizer,
        records,
        [(0, len(records))],
        [0],
        gen_cfg,
        max_seq_len=max_seq_len,
        seed=seed,
        engine=engine,
        model=model,
        on_chunk=lambda _i, r: results.append(r),
    )
    (res,) = results
    if require_traces:
        res.check_usable()
    return res


def _generation_replica(job: dict, rank: int, chunks) -> None:
    """One engine replica of a generation job: generate the chunks it takes from ``chunks``.

    Runs in the job's process (one replica) or in a spawned replica process
    (:func:`eagle3_pipeline.parallel.run_replicas`). The engine is fed continuously
    (:func:`generate_chunks`); each chunk is written atomically into the job's chunk store as
    soon as its last prompt is answered, and the replica's timing to ``replica-<rank>.json``.
    """
    import json

    from .engine import build_llm, engine_identity, shutdown_llm
    from .hygiene import ProcessRecord
    from .io import write_json_atomic
    from .resume import ChunkStore
    from .target_model import load_tokenizer

    params, records, ranges = job["params"], job["records"], job["ranges"]
    store = ChunkStore.attach(job["traces"], ".jsonl")
    stem = Path(job["traces"]).stem
    pids = ProcessRecord(pids_of(job["traces"]), stem if rank == 0 else f"{stem}.replica{rank}")
    load = Timer()
    llm = build_llm(
        job["target"],
        params["vllm"],
        seed=params["seed"],
        max_model_len=params["max_seq_len"],
        trust_remote_code=params["trust_remote_code"],
    )
    load_s = load.seconds
    pids.record()
    tokenizer = load_tokenizer(job["target"], params["trust_remote_code"])
    engine = engine_identity()
    gen = Timer()
    tokens = done = 0

    def write_chunk(i: int, res: ShardResult) -> None:
        nonlocal tokens, done
        a, b = ranges[i]
        tokens += res.summary()["completion_tokens"]
        done += 1
        lines = [{"trace": t} for t in res.traces] + [{"reject": r.as_dict()} for r in res.rejects]
        with store.writing(i) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(x, ensure_ascii=False, sort_keys=True) + "\n" for x in lines)
        logger.info("chunk %d/%d done (prompts %d-%d)", i + 1, len(ranges), a, b - 1)

    generate_chunks(
        llm,
        tokenizer,
        records,
        ranges,
        chunks,
        params["generation"],
        max_seq_len=params["max_seq_len"],
        seed=params["seed"],
        engine=engine,
        model=job["model"],
        on_chunk=write_chunk,
        total=sum(ranges[i][1] - ranges[i][0] for i in job["todo"]),
    )
    gen_s = gen.seconds
    shutdown_llm(llm)
    pids.clear()
    write_json_atomic(
        store.dir / f"replica-{rank}.json",
        {"rank": rank, "chunks": done, "model_load_seconds": load_s, "generate_seconds": gen_s, "completion_tokens": tokens},
    )


def run_generation_shard(
    prompts_path: str,
    out: dict,
    target: str,
    params: dict,
    *,
    chunk_prompts: int,
    host_lock_enabled: bool = True,
) -> dict:
    """The generate_traces job: resumable, optionally data-parallel generation of one prompt shard.

    Prompts (in id order) are generated in chunks of ``chunk_prompts``; each finished
    chunk is kept (:mod:`eagle3_pipeline.resume`), so a killed job's rerun generates
    only the unfinished chunks and the final traces are identical to an uninterrupted
    run's (same order; greedy decoding or an engine seed). The job's lifecycle (host-wide lock,
    a shard another job finished, stale engines, replicas) is :func:`eagle3_pipeline.shard_job.run_shard_job`'s;
    a chunk is :func:`_generation_replica`'s, its traces and rejects one JSONL file. With
    ``vllm.data_parallel_size = D > 1``, D engine replicas (each on tensor × pipeline
    parallel GPUs, or ``vllm.replicas_per_gpu`` of them on each GPU) share the chunks
    (:mod:`eagle3_pipeline.parallel`).

    Args:
        prompts_path: ``prompts/shard-NNNNN.jsonl``.
        out: output paths ``{"traces", "rejects", "summary"}``.
        target: target model directory.
        params: ``{"generation", "vllm", "seed", "max_seq_len", "trust_remote_code"}``.
        chunk_prompts: prompts per resumable chunk.
        host_lock_enabled: hold the host-wide full-model lock while the engines run.

    Returns:
        the summary written to ``out["summary"]``.

    Raises:
        InputError: a prompt of the shard was edited after prepare_prompts wrote it (its id is not
            its messages' hash: :func:`eagle3_pipeline.prompts.edited_prompts`), every
            prompt of the shard was rejected, the installed vLLM cannot draft
            for the target with EAGLE-3 (:func:`eagle3_pipeline.engine.check_eagle3_target`), or
            its tokenizer cannot render a chat prompt (:func:`eagle3_pipeline.target_model.tokenizer_problem`).
        ValueError: fewer GPUs visible than the replicas need.
        RuntimeError: a replica failed (finished chunks are kept).
    """
    from .config import result_settings
    from .engine import check_eagle3_target
    from .io import file_stat, iter_jsonl, read_jsonl, sha256_file, sha256_json, write_jsonl_atomic
    from .shard_job import ShardJob, ShardRun, run_shard_job
    from .target_model import model_fingerprint, tokenizer_problem

    numbered = list(iter_jsonl(prompts_path))
    if (edited := edited_prompts(prompts_path, numbered)) is not None:  # each id is its messages' hash, as prepare_prompts wrote it
        raise InputError(edited)
    # the first stage fails for a target the evaluation's vLLM could not draft for, not the last
    check_eagle3_target(target, params["trust_remote_code"], params["max_seq_len"])
    if (why := tokenizer_problem(target, params["trust_remote_code"])) is not None:
        raise InputError(why)
    records = sorted((r for _, r in numbered), key=lambda r: r["id"])
    model = {"path": target, "fingerprint": model_fingerprint(target)}
    # runtime settings (data-parallel layout, ...) do not change the traces: a resume may use
    # others; the chunk size is the fingerprint's own (it defines the chunks)
    fp_params = {**params} | {sec: result_settings(params, sec) for sec in ("generation", "vllm")}
    fingerprint = sha256_json({"prompts": sha256_file(prompts_path), "model": model, "params": fp_params, "chunk": chunk_prompts})
    vcfg = params["vllm"]

    def assemble(run: ShardRun) -> dict:
        """The traces (in prompt-id order) and rejects of every chunk, and the summary's fields."""
        result = ShardResult()
        for i in range(len(run.ranges)):
            for x in read_jsonl(run.store.path(i)):
                if "trace" in x:
                    result.traces.append(x["trace"])
                else:
                    result.rejects.append(Reject(**x["reject"]))
        result.traces.sort(key=lambda t: t["id"])
        result.check_usable()
        write_jsonl_atomic(out["rejects"], (r.as_dict() for r in result.rejects))
        write_jsonl_atomic(out["traces"], result.traces)
        gen_s = run.stats.get("generate_seconds", 0.0)
        return result.summary() | {
            "tensor_parallel_size": vcfg["tensor_parallel_size"],
            "pipeline_parallel_size": vcfg["pipeline_parallel_size"],
            "generate_seconds": round(gen_s, 3),
            "engine_wall_seconds": round(run.wall_seconds, 3),
            "completion_tokens_per_second": rate(run.stats.get("completion_tokens", 0), gen_s),
            SUMMARY_HASH_KEYS[0]: sha256_file(out["traces"]),
            SUMMARY_HASH_KEYS[1]: file_stat(out["traces"]),  # the shard as hashed (io.checked_sha256)
        }

    summary = run_shard_job(
        ShardJob(
            outputs=[out["traces"], out["rejects"]],
            record=out["summary"],
            fingerprint=fingerprint,
            chunk_suffix=".jsonl",
            num_items=len(records),
            chunk_size=chunk_prompts,
            chunk_key="generation.chunk_prompts",
            worker=_generation_replica,
            worker_job={"params": params, "records": records, "traces": out["traces"], "target": target, "model": model},
            assemble=assemble,
            replicas=vcfg["data_parallel_size"],
            gpus_per_replica=vcfg["tensor_parallel_size"] * vcfg["pipeline_parallel_size"],
            replicas_per_gpu=vcfg.get("replicas_per_gpu", 1),
            keep_finished=True,
            record_hash_keys=SUMMARY_HASH_KEYS,
        ),
        host_lock_enabled=host_lock_enabled,
    )
    logger.info("generation: %s", {k: v for k, v in summary.items() if k != "replicas"})
    return summary

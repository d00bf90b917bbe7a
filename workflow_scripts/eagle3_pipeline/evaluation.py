"""evaluate_drafter: acceptance length of the drafter measured in vLLM.

vLLM serves the target with ``speculative_config={"method": "eagle3", "model": <drafter>,
"num_speculative_tokens": k}`` on held-out prompts; τ comes from vLLM's own
``spec_decode`` counters (``LLM.get_metrics()``):

* τ (mean acceptance length) = 1 + accepted tokens / drafts — each verification step
  emits the accepted draft tokens plus one token from the target
  (vLLM ``v1/spec_decode/metrics.py`` defines the same ratio);
* acceptance rate at position ``i`` = accepted at position ``i`` / drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counters(metrics: Iterable) -> dict:
    """Sum vLLM's spec-decode counters over engines from ``LLM.get_metrics()`` output.

    Returns:
        ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens": int,
        "accepted_per_position": list[int]}``.

    Raises:
        RuntimeError: the counters are absent (speculative decoding was not active, or
            the engine ran with ``disable_log_stats=True``).
    """
    out = {v: 0 for v in COUNTERS.values()}
    per_pos: list[int] = []
    found = False
    for m in metrics:
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
            found = True
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            per_pos += [0] * (len(vals) - len(per_pos))
            per_pos = [a + (vals[i] if i < len(vals) else 0) for i, a in enumerate(per_pos)]
    if not found:
        raise RuntimeError("vLLM reported no spec_decode counters: speculative decoding was not active")
    out["accepted_per_position"] = per_pos
    return out


def acceptance_report(counters: dict, num_speculative_tokens: int) -> dict:
    """τ and per-position acceptance from spec-decode counters.

    Raises:
        RuntimeError: no drafts were made (nothing to measure).
    """
    drafts = counters["num_drafts"]
    if drafts <= 0:
        raise RuntimeError("vLLM made no drafts: no acceptance length to report (outputs too short?)")
    acc = counters["num_accepted_tokens"]
    per_pos = counters["accepted_per_position"]
    return {
        "acceptance_length": 1.0 + acc / drafts,
        "num_speculative_tokens": num_speculative_tokens,
        "num_drafts": drafts,
        "num_draft_tokens": counters["num_draft_tokens"],
        "num_accepted_tokens": acc,
        "draft_acceptance_rate": acc / counters["num_draft_tokens"] if counters["num_draft_tokens"] else 0.0,
        "per_position_acceptance_rate": [a / drafts for a in per_pos],
        "accepted_per_position": per_pos,
    }


def run_eval(llm, tokenizer, questions: list[dict], eval_cfg: dict, chat_template_kwargs: dict | None = None) -> tuple[dict, list[dict]]:
    """Generate answers to the first turn of each question and read τ from vLLM.

    Returns:
        ``(report, outputs)``: the acceptance report, and per question
        ``{"id", "num_prompt_tokens", "num_output_tokens", "text"}``.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .generation import render_prompt_ids

    prompts = [render_prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}], chat_template_kwargs) for q in questions]
    params = SamplingParams(temperature=eval_cfg["temperature"], max_tokens=eval_cfg["max_tokens"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    report = acceptance_report(spec_decode_counters(llm.get_metrics()), eval_cfg["num_speculative_tokens"])
    rows = [
        {"id": q["id"], "num_prompt_tokens": len(p), "num_output_tokens": len(o.outputs[0].token_ids), "text": o.outputs[0].text}
        for q, p, o in zip(questions, prompts, outs, strict=True)
    ]
    report["num_prompts"] = len(questions)
    report["output_tokens"] = sum(r["num_output_tokens"] for r in rows)
    return report, rows

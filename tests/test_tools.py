"""Tool calling without a model: the prompt pieces, the call parser, history checks, the plan.

Covers ``agent/engine/tools.py``, ``agent/server/structured.py`` and the tool side of
``agent/engine/chat.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.engine.chat import ByteTokenizer, Message, TextPiece, render
from agent.engine.tools import CallStream, Tool, ToolCall, ToolError, call_grammar, split_calls
from agent.grammar import GrammarEngine
from agent.server import schemas as S
from agent.server.structured import output_plan


def fn(name: str, **props: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": params},
    }


WEATHER = fn("get_weather", city={"type": "string"})
TIME = fn("get_time", zone={"type": "string"})


def request(**kw: Any) -> S.ChatCompletionRequest:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return S.ChatCompletionRequest.model_validate(kw)


def texts(pieces: list[Any], tok: ByteTokenizer) -> list[str]:
    return [tok.decode(list(p.ids)) for p in pieces if isinstance(p, TextPiece)]


def test_each_definition_is_its_own_piece_and_tokenizes_the_same_in_any_list() -> None:
    tok = ByteTokenizer()
    one = render(tok, [Message("user", ("hi",))], [WEATHER])
    two = render(tok, [Message("system", ("Be brief.",)), Message("user", ("hi",))], [TIME, WEATHER])
    weather = json.dumps(WEATHER) + "\n"
    assert weather in texts(one, tok)
    assert weather in texts(two, tok)
    ids = {p.ids for p in one + two if isinstance(p, TextPiece) and tok.decode(list(p.ids)) == weather}
    assert len(ids) == 1  # the same tokens wherever it sits: the prompt cache reuses it by content
    assert "Be brief." in texts(two, tok)  # the block joins the request's own system turn


def test_a_template_that_renders_tools_is_cut_around_each_definition() -> None:
    class Native(ByteTokenizer):
        chat_template = "{{ tools }}"  # type: ignore[assignment]

        def apply_chat_template(self, messages: Any, tools: Any = None, **kw: Any) -> str:
            head = "<tools>" + "".join("\n" + json.dumps(t) for t in tools or []) + "\n</tools>"
            return head + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)

    tok = Native()
    got = texts(render(tok, [Message("user", ("hi",))], [WEATHER, TIME]), tok)
    assert json.dumps(WEATHER) in got
    assert json.dumps(TIME) in got
    assert not any("# Tools" in t for t in got)  # no fallback block when the template has its own


def test_call_stream_holds_back_a_partial_marker_and_matches_the_whole_parse() -> None:
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> <tool'
    stream = CallStream(["get_weather"])
    items: list[str | ToolCall] = []
    for ch in text:
        got = list(stream.push(ch))
        if ch == "<" and not items:
            assert got == []  # may start "<tool_call>": held back
        items += got
    items += list(stream.close())
    calls = [i for i in items if isinstance(i, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "".join(i for i in items if isinstance(i, str)) == "Sure.  <tool"
    content, whole = split_calls(text, ["get_weather"])
    assert content == "Sure.  <tool"
    assert [c.arguments for c in whole] == [c.arguments for c in calls]


def test_a_call_of_an_unknown_tool_or_bad_json_stays_content() -> None:
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert split_calls(bad, ["get_weather"]) == (bad, [])
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert split_calls(broken, ["get_weather"]) == (broken, [])
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert [c.name for c in split_calls(unclosed, ["get_weather"])[1]] == ["get_weather"]


def call_msg(call_id: str, args: str = '{"city": "Oslo"}') -> dict[str, Any]:
    function = {"name": "get_weather", "arguments": args}
    return {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": function}]}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "tool_call_id": "c1", "content": "x"}], "messages[1].tool_call_id"),
        (
            [call_msg("c1"), {"role": "tool", "tool_call_id": "c2", "content": "x"}],
            "messages[2].tool_call_id",
        ),
        ([call_msg("c1"), {"role": "tool", "content": "x"}], "messages[2].tool_call_id"),
        ([call_msg("c1"), {"role": "user", "content": "and?"}], "messages[2]"),
        ([call_msg("c1", "[1]")], "messages[1].tool_calls[0].function.arguments"),
        ([call_msg("c1", "{oops")], "messages[1].tool_calls[0].function.arguments"),
    ],
)
def test_history_that_does_not_match_is_refused_naming_the_field(messages: list[Any], param: str) -> None:
    body = request(messages=[{"role": "user", "content": "hi"}, *messages], tools=[WEATHER])
    with pytest.raises(ToolError) as err:
        output_plan(body)
    assert err.value.param == param


def test_answered_history_is_accepted() -> None:
    answered = [call_msg("c1"), {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]
    output_plan(request(messages=[{"role": "user", "content": "hi"}, *answered], tools=[WEATHER]))


def test_the_plan_of_each_tool_choice() -> None:
    assert output_plan(request()).grammar is None
    auto = output_plan(request(tools=[WEATHER, TIME]))
    assert auto.parse_calls
    assert auto.grammar is None
    assert auto.tool_names == ("get_weather", "get_time")
    none = output_plan(request(tools=[WEATHER], tool_choice="none"))
    assert none.tools == ()
    assert not none.parse_calls
    required = output_plan(request(tools=[WEATHER, TIME], tool_choice="required"))
    assert required.grammar is not None
    assert "get_time" in required.grammar
    named = output_plan(
        request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    assert named.grammar is not None
    assert "get_weather" not in named.grammar
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    both = output_plan(request(tools=[WEATHER], response_format=fmt))
    assert both.grammar is not None
    assert both.grammar.startswith("start: %json")
    assert "call_block" in both.grammar
    with pytest.raises(ToolError, match="needs tools"):
        output_plan(request(tool_choice="required"))
    with pytest.raises(ToolError, match="not in tools"):
        output_plan(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(ToolError, match="twice"):
        output_plan(request(tools=[WEATHER, WEATHER]))
    with pytest.raises(ToolError, match="must match"):
        output_plan(request(tools=[fn("get weather")]))


def test_call_grammar_takes_exactly_one_call_of_the_given_tools() -> None:
    tok = ByteTokenizer()
    engine = GrammarEngine(tok, [1], 512)
    grammar = call_grammar([Tool("get_weather", None, WEATHER["function"]["parameters"])])

    def accepts(text: str) -> bool:
        c = engine.constraint(grammar)
        for t in tok.encode(text):
            if not c.allowed(512)[t]:
                return False
            c.advance(t)
        return c.accepting

    assert accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>')

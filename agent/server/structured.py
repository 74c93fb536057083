"""The structured side of a chat completion: tools, grammars, tool calls and logprobs out.

:func:`output_plan` reads ``tools``, ``tool_choice`` and ``response_format`` and checks they hold
together (a :class:`~agent.engine.tools.ToolError` naming the field otherwise):

=======================  ==================  =====================================================
tool_choice              tools in prompt     grammar
=======================  ==================  =====================================================
``none`` (or no tools)   no                  ``response_format``'s, if any
``auto`` (the default)   yes                 none, or ``response_format``'s *or* one call
``required`` / named     yes                 one call (of the named function), arguments under
                                             its parameter schema
=======================  ==================  =====================================================

:func:`logprob_content` and :func:`call_out` shape what comes back in OpenAI's form.

Not here: compiling the grammar (``grammar.py``), rendering or parsing calls (``tools.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.engine.generation import TokenLogprob
from agent.engine.tools import Tool, ToolCall, ToolError, call_grammar, check_history, check_tools
from agent.grammar import schema_rule
from agent.server import schemas as S


@dataclass(frozen=True)
class OutputPlan:
    tools: tuple[Tool, ...] = ()  # rendered into the prompt
    grammar: str | None = None  # Lark, decoded under when set
    parse_calls: bool = False  # look for tool calls in the output

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    @property
    def definitions(self) -> tuple[dict[str, Any], ...]:
        return tuple(t.definition() for t in self.tools)


def output_plan(body: S.ChatCompletionRequest) -> OutputPlan:
    tools = tuple(
        Tool(d.function.name, d.function.description, d.function.parameters, bool(d.function.strict))
        for d in body.tools or ()
    )
    check_tools(tools)
    check_history(body.messages)
    choice = body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise ToolError("tool_choice needs tools", "tool_choice")
    fmt = format_rule(body.response_format)
    if not tools or choice == "none":
        return OutputPlan(grammar=None if fmt is None else f"start: {fmt}\n")
    if choice is None or choice == "auto":
        if fmt is None:
            return OutputPlan(tools, None, parse_calls=True)
        calls = call_grammar(tools).replace("start:", "call_block:", 1)
        return OutputPlan(tools, f"start: {fmt} | call_block\n{calls}", parse_calls=True)
    if isinstance(choice, S.NamedToolChoice):
        chosen = [t for t in tools if t.name == choice.function.name]
        if not chosen:
            raise ToolError(
                f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        return OutputPlan(tools, call_grammar(chosen), parse_calls=True)
    return OutputPlan(tools, call_grammar(tools), parse_calls=True)


def format_rule(fmt: S.TextFormat | S.JSONObjectFormat | S.JSONSchemaFormat | None) -> str | None:
    """The Lark rule body of ``response_format`` (None for plain text)."""
    if fmt is None or isinstance(fmt, S.TextFormat):
        return None
    if isinstance(fmt, S.JSONObjectFormat):
        return schema_rule({"type": "object"})
    spec = fmt.json_schema
    if not spec.json_schema:
        raise ToolError("json_schema needs a schema", "response_format.json_schema.schema")
    return schema_rule(spec.json_schema, lenient=not spec.strict)


def logprob_content(tokenizer: Any, logprobs: Sequence[TokenLogprob]) -> list[S.TokenLogprobOut]:
    """OpenAI's ``logprobs.content``: each token's text, UTF-8 bytes, logprob and top list.
    A token that ends inside a UTF-8 character shows U+FFFD in its text (its bytes are exact
    only for a byte-level tokenizer's whole characters)."""

    def entry(token: int, logprob: float) -> S.TopLogprob:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return S.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    out = []
    for lp in logprobs:
        head = entry(lp.token, lp.logprob)
        top = [entry(t, v) for t, v in lp.top]
        out.append(
            S.TokenLogprobOut(token=head.token, logprob=head.logprob, bytes=head.bytes, top_logprobs=top)
        )
    return out


def call_out(call: ToolCall) -> S.ToolCallOut:
    return S.ToolCallOut(id=call.id, function=S.ToolCallFunction(name=call.name, arguments=call.arguments))

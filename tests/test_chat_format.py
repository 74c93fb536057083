"""An agent window laid out in the model's own chat template (``agent.engine.chat.chat_format``).

The window keeps turns as chunks and moves them around, so a template is cut into the text it
writes around a system message, a user message, the assistant's turn; a template whose turns
depend on their neighbours or their place is refused, and the agent then lays the window out in
ChatML with a warning.
"""

from __future__ import annotations

import copy
import logging

import pytest
from transformers import AutoTokenizer

from agent.adapters.loading import embedded_text_model_dir
from agent.engine.chat import ChatML, TemplateChat, TemplateError, chat_format

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Mistral's rule: roles must alternate user/assistant after an optional system message.
ALTERNATING = (
    "{%- for message in messages %}{%- if message['role'] == 'user' and loop.index0 > 0 and "
    "messages[loop.index0 - 1]['role'] == 'user' %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant') }}{%- endif %}{%- if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{%- elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{%- else %}{{ message['content'] + '</s>' }}{%- endif %}{%- endfor %}"
)
# A turn that carries its own index is written differently wherever it sits.
NUMBERED = (
    "{%- for message in messages %}{{ '#' ~ loop.index ~ ' ' ~ message['role'] ~ ': ' ~ message['content'] "
    "~ '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}"
)


@pytest.fixture
def tokenizer():  # a fresh copy: each test sets its own template
    return AutoTokenizer.from_pretrained(embedded_text_model_dir())


def test_smollm2_template_is_chatml(tokenizer) -> None:
    fmt, chatml = chat_format(tokenizer), ChatML()
    assert isinstance(fmt, TemplateChat)
    for turn in ("system", "user_text", "instruction"):
        assert getattr(fmt, turn)("Look.") == getattr(chatml, turn)("Look.")
    assert fmt.end_of_turn() == chatml.end_of_turn()


def test_llama3_template_cut_into_turns(tokenizer) -> None:
    tokenizer.chat_template = LLAMA3
    tokenizer.bos_token = "<|bos|>"
    fmt = chat_format(tokenizer)
    system = "<|bos|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    assert fmt.system("Be brief.") == system
    assert fmt.user_text("a frame") == "<|start_header_id|>user<|end_header_id|>\n\na frame<|eot_id|>"
    assert fmt.instruction("Why?") == (
        "<|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert fmt.end_of_turn() == "<|eot_id|>"
    # the pieces put together are what the template writes for the whole conversation
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q"},
    ]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = fmt.system("S") + fmt.user_text("U1") + fmt.instruction("U2") + "A" + fmt.end_of_turn()
    assert pieces + fmt.instruction("Q") == whole


@pytest.mark.parametrize("template", [ALTERNATING, NUMBERED], ids=["alternating", "numbered"])
def test_templates_that_cannot_be_cut_are_refused(tokenizer, template: str) -> None:
    tokenizer.chat_template = template
    with pytest.raises(TemplateError, match="chat template"):
        chat_format(tokenizer)


def test_the_agent_uses_the_template_or_says_why_not(
    smollm2, tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.loop import Agent

    adapter = copy.copy(smollm2)  # the shared model, with a tokenizer of this test's own
    adapter.tokenizer = tokenizer
    tokenizer.chat_template = LLAMA3
    tokenizer.bos_token = "<|bos|>"
    agent = Agent(adapter, "Be brief.")
    assert isinstance(agent.chat, TemplateChat)
    system = agent.context.view()[0]
    expected = "<|bos|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    assert system.n_tokens == len(tokenizer(expected, add_special_tokens=False)["input_ids"])
    tokenizer.chat_template = ALTERNATING
    with caplog.at_level(logging.WARNING, logger="agent.loop"):
        agent = Agent(adapter, "Be brief.")
    assert isinstance(agent.chat, ChatML)
    assert "laid out in ChatML" in caplog.text

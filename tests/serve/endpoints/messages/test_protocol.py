"""The Messages request read into chat's (serve/endpoints/messages/protocol.py): system, text,
tool_use and tool_result blocks as chat messages in the order the template needs, tools and
tool_choice as chat's, a prefill recognised; and the refusals by name."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from doel.serve.endpoints.chat.protocol import ChatCompletionRequest
from doel.serve.endpoints.messages.protocol import CountTokensRequest, MessagesRequest

TOOL = {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}}


def body(**kw) -> dict:
    return CountTokensRequest(**kw).chat_body()


def test_a_conversation_with_a_call_and_its_result_is_chats_messages_in_order():
    got = body(
        system=[{"type": "text", "text": "ছোট"}, {"type": "text", "text": " করে"}],
        messages=[
            {"role": "user", "content": "যোগ করো"},
            {"role": "assistant", "content": [{"type": "text", "text": "দেখি"}, CALL]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                {"type": "text", "text": "আর?"},
            ]},
        ],
        tools=[TOOL],
        tool_choice={"type": "auto"},
    )  # fmt: skip
    roles = [m["role"] for m in got["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert got["messages"][0]["content"] == "ছোট করে"
    (call,) = got["messages"][2]["tool_calls"]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"a": 2}
    assert got["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "2"}
    assert got["tools"][0]["function"]["parameters"] == TOOL["input_schema"]
    assert got["tool_choice"] == "auto"
    ChatCompletionRequest(**got).turns()  # chat reads it: the tool message answers the call


@pytest.mark.parametrize(
    ("choice", "chat"),
    [
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
)
def test_tool_choice_is_chats(choice, chat):
    asked = body(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice)
    assert asked["tool_choice"] == chat


def test_an_error_result_says_so_and_a_last_assistant_text_is_a_prefill():
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no", "is_error": True}
    turns = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [result]},
        {"role": "assistant", "content": "উত্তর:"},
    ]
    req = MessagesRequest(max_tokens=4, messages=turns)
    assert req.prefill() == "উত্তর:"
    got = req.chat_body()["messages"]
    assert [m["role"] for m in got] == ["user", "assistant", "tool"]  # the prefill is not a turn
    assert got[-1]["content"] == "error: no"


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),  # required
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 1.5},
         "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "top_logprobs": 2},
         "top_logprobs"),
    ],
)  # fmt: skip
def test_what_it_does_not_read_is_refused_by_name(kw, said):
    with pytest.raises(ValidationError, match=said):
        MessagesRequest(**kw)


def test_a_call_in_a_user_turn_and_a_nameless_tool_choice_are_refused_by_path():
    with pytest.raises(ValueError, match=r"messages\[0\]: tool_use blocks belong"):
        body(messages=[{"role": "user", "content": [CALL]}])
    with pytest.raises(ValueError, match="names the tool"):
        body(
            messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice={"type": "tool"}
        )

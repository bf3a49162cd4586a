"""Chat messages checked one by one before a chat template sees them.

A template renders whatever it is given: a message without content comes out as "None" or as
nothing, a role it does not know may be dropped, a list of parts may be printed as a Python
list. A malformed chat would run as another prompt, so each problem makes its row an error row
naming the message and the field (`[2].content: missing`).
"""

from __future__ import annotations

from typing import Any

import orjson

ROLES = ("system", "developer", "user", "assistant", "tool")  # the OpenAI chat roles


def message_problem(messages: list) -> str | None:
    """The first problem of a chat's messages as `[index].field: what`, or None."""
    for i, message in enumerate(messages):
        problem = _problem(message)
        if problem is not None:
            return f"[{i}]{problem}"
    return None


def _problem(m: Any) -> str | None:
    if not isinstance(m, dict):
        return f": a message must be an object {{role, content}}, got {type(m).__name__}"
    role = m.get("role")
    if role not in ROLES:
        return ".role: missing" if role is None else f".role: {role!r} is not one of {list(ROLES)}"
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            return f".tool_calls: only an assistant message calls tools, this one is {role!r}"
        problem = _tool_calls_problem(calls)
        if problem is not None:
            return problem
    content = m.get("content")
    if content is None:  # an assistant turn that only calls tools may have no text
        return None if calls else f".content: {'null' if 'content' in m else 'missing'}"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f".content: must be a string or a list of text parts, got {type(content).__name__}"
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            return f".content[{j}]: only text parts {{type: text, text}} are read, got {kind!r}"
        if not isinstance(part.get("text"), str):
            return f".content[{j}].text: must be a string"
    return None


def _tool_calls_problem(calls: Any) -> str | None:
    if not isinstance(calls, list) or not calls:
        return ".tool_calls: must be a non-empty list of {type: function, function: {name, arguments}}"
    for j, call in enumerate(calls):
        where = f".tool_calls[{j}]"
        if not isinstance(call, dict):
            return f"{where}: must be an object {{type: function, function: {{name, arguments}}}}"
        if call.get("type", "function") != "function":
            return f"{where}.type: must be 'function', got {call['type']!r}"
        if "id" in call and not isinstance(call["id"], str):
            return f"{where}.id: must be a string"
        fn = call.get("function")
        if not isinstance(fn, dict):
            return f"{where}.function: {'missing' if fn is None else 'must be an object {name, arguments}'}"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"{where}.function.name: must be a non-empty string"
        arguments = fn.get("arguments")
        if not isinstance(arguments, str | dict):
            return f"{where}.function.arguments: must be a JSON string or an object"
        if isinstance(arguments, str):  # the OpenAI form: an object's JSON, which templates parse
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return f"{where}.function.arguments: not JSON: {arguments[:60]!r}"
            if not isinstance(arguments, dict):
                return f"{where}.function.arguments: must encode an object, got {type(arguments).__name__}"
    return None

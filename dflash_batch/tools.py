"""Tool calls between a conversation's turns: the functions of the job's tool module, the calls
an assistant turn wrote (in its chat template's format), and their results as tool messages.

Nothing the model writes is evaluated: a call names a public function of the named module and
gives JSON arguments, which are parsed as JSON and passed as keyword arguments. A call that
names no such function, whose arguments are not a JSON object, that raises or that runs past
the timeout gives the model a tool message saying so (and counts as a tool error). A call past
its timeout cannot be stopped: it runs on in a daemon thread (which does not keep the process
from exiting) and its answer is dropped."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError as CallTimedOut
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dflash_batch.job import JobError, ToolsSpec

# JSON Schema types of the annotations a definition read from a signature understands.
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str                 # as the model wrote them (JSON text, or not)


@dataclass(slots=True)
class ToolResult:
    call: ToolCall
    content: str
    error: bool                    # the call failed: the content says why


def import_object(dotted: str, field: str) -> Any:
    """`module` or `module:attribute`, imported (a JobError naming `field` if it is not there)."""
    module_name, _, attribute = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the job's
        raise JobError(f"{field}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    if not attribute:
        return module
    found = getattr(module, attribute, None)
    if not callable(found):
        raise JobError(f"{field}: {module_name!r} has no function {attribute!r}")
    return found


def public_functions(module: ModuleType) -> dict[str, Callable]:
    """The module's own public functions (not those it imported)."""
    return {name: f for name, f in vars(module).items() if not name.startswith("_") and inspect.isfunction(f)
            and f.__module__ == module.__name__}


def definition(name: str, function: Callable) -> dict:
    """An OpenAI-style tool definition read from a function's signature and docstring."""
    properties, required = {}, []
    for p in inspect.signature(function).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        properties[p.name] = {"type": _JSON_TYPES[p.annotation]} if p.annotation in _JSON_TYPES else {}
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "function", "function": {"name": name, "description": inspect.getdoc(function) or "",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def template_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template writes: kimi, hermes, or None (neither)."""
    template = chat_template or ""
    if "tool_call_begin" in template:
        return "kimi"
    if "<tool_call>" in template:
        return "hermes"
    return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_KIMI = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*<\|tool_call_end\|>",
                   re.DOTALL)
_STARTS = {"hermes": "<tool_call>", "kimi": "<|tool_calls_section_begin|>"}


def parse_calls(text: str, fmt: str, turn: int) -> tuple[str, list[ToolCall]]:
    """(the turn's text before its calls, the calls) of an assistant turn's text written with
    its special tokens; call ids are `call_<turn>_<i>` (hermes) or the model's own (kimi)."""
    calls = []
    if fmt == "hermes":
        for i, body in enumerate(_HERMES.findall(text)):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            except (ValueError, TypeError, KeyError):
                name, arguments = "", body  # the call's JSON itself is bad: reported as such
            calls.append(ToolCall(f"call_{turn}_{i}", str(name), arguments))
    else:
        for i, (ident, arguments) in enumerate(_KIMI.findall(text)):
            # functions.NAME:INDEX
            name = ident.removeprefix("functions.").rsplit(":", 1)[0]
            calls.append(ToolCall(ident or f"call_{turn}_{i}", name, arguments))
    start = text.find(_STARTS[fmt])
    return (text[:start] if start >= 0 else text), calls


def module_tools(spec: ToolsSpec) -> tuple[dict[str, Callable], list[dict]]:
    """The tool module's functions and their definitions for the chat template."""
    module = import_object(spec.module, "conversation.tools.module")
    functions = public_functions(module)
    if not functions:
        raise JobError(f"conversation.tools.module: {spec.module!r} defines no public function")
    given = getattr(module, "TOOLS", None)
    return functions, given if isinstance(given, list) else [definition(n, f) for n, f in functions.items()]


def in_thread(function: Callable, arguments: dict) -> Future:
    """function(**arguments) on a daemon thread of its own, as a future."""
    future: Future = Future()

    def call() -> None:
        try:
            future.set_result(function(**arguments))
        except BaseException as e:  # noqa: BLE001 - whatever the tool raises is the model's to read
            future.set_exception(e)

    threading.Thread(target=call, name="dflash-tool", daemon=True).start()
    return future


class Toolbox:
    """The job's tool module and its definitions."""

    def __init__(self, spec: ToolsSpec, fmt: str):
        self.functions, self.definitions = module_tools(spec)
        self.timeout, self.format = spec.timeout_s, fmt

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Every call, at once, each within the timeout from now (blocks: run it off the
        engine's thread)."""
        started = [(call, self._start(call)) for call in calls]
        deadline = time.monotonic() + self.timeout
        results = []
        for call, future in started:
            if isinstance(future, ToolResult):
                results.append(future)
                continue
            try:
                value = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except CallTimedOut:
                results.append(ToolResult(call, f"error: {call.name} timed out after {self.timeout:g} s", True))
            except Exception as e:  # noqa: BLE001 - the model is told what the tool raised
                results.append(ToolResult(call, f"error: {call.name} raised {type(e).__name__}: {e}", True))
            else:
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
                results.append(ToolResult(call, text, False))
        return results

    def _start(self, call: ToolCall):
        """The call's future on the pool, or at once its error result."""
        function = self.functions.get(call.name)
        if not call.name:
            return ToolResult(call, 'error: the tool call is not valid JSON ({"name": ..., "arguments": {...}} '
                                    'expected)', True)
        if function is None:
            known = ", ".join(sorted(self.functions))
            return ToolResult(call, f"error: no tool named {call.name!r} (tools: {known})", True)
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as e:
            return ToolResult(call, f"error: the arguments of {call.name} are not valid JSON: {e}", True)
        if not isinstance(arguments, dict):
            return ToolResult(call, f"error: the arguments of {call.name} must be a JSON object", True)
        return in_thread(function, arguments)

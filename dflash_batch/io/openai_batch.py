"""OpenAI Batch API files: request lines in (`input.format: openai_batch`), response lines out
(`dflash-batch export --format openai_batch`).

A request line is `{custom_id, method, url, body}` with a chat completions or a completions body.
`request_fields` turns one into what the row preparer reads: the custom id, the prompt (chat
messages, text or token ids), the body's model, and the sampling fields mapped onto ours. A body
field with no counterpart here is an error naming it (that row only), never dropped: a request
would otherwise run with settings other than the ones its author wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

import orjson

from dflash_batch.keys import hash64

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"

# body field -> our sampling field, where the value carries over unchanged. Past OpenAI's own
# fields, the extensions vLLM's server accepts under the same names.
_SAME = {"temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
         "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
         "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
         "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
         "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
         "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
# Fields that change nothing generated, in OpenAI's API either: accepted and not used.
_NO_EFFECT = {"model", "user", "metadata", "store"}


class RequestError(ValueError):
    """A request line that cannot run; the message names the field."""


def request_fields(line: dict) -> dict[str, Any]:
    """{custom_id, url, model, prompt kind -> value, sampling: {our field: value}, origin: {our
    field: body field}} of one request line; raises RequestError naming what is wrong."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestError(f"custom_id must be a non-empty string, got {custom_id!r}")
    extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if extra:
        raise RequestError(f"unknown key(s) {extra} in the request line")
    if line.get("method", "POST") != "POST":
        raise RequestError(f"method must be POST, got {line.get('method')!r}")
    url, body = line.get("url"), line.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RequestError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise RequestError("body must be an object")
    out: dict[str, Any] = {"custom_id": custom_id, "url": url, "model": body.get("model")}
    sampling: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def put(field: str, value: Any, name: str) -> None:
        if field in sampling:
            raise RequestError(f"body.{name}: sets {field} a second time (body.{origin[field]})")
        sampling[field], origin[field] = value, name

    chat = url == CHAT_URL
    prompt_key = "messages" if chat else "prompt"
    if prompt_key not in body:
        raise RequestError(f"body.{prompt_key} is missing")
    prompt = body[prompt_key]
    if chat:  # OpenAI's newer `developer` role is what chat templates know as `system`
        out["messages"] = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                           for m in prompt] if isinstance(prompt, list) else prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        out["input_ids"] = prompt
    elif isinstance(prompt, list) and len(prompt) == 1:
        out["prompt"] = prompt[0]  # a batch of one prompt
    elif isinstance(prompt, list):
        raise RequestError("body.prompt: one prompt per request line (a list of several is a batch)")
    else:
        out["prompt"] = prompt
    for name, value in body.items():
        if name == prompt_key or value is None or name in _NO_EFFECT:
            continue
        if name in _SAME:
            put(_SAME[name], value, name)
        elif name == "stop":
            put("stop", [value] if isinstance(value, str) else value, name)
        elif name == "logit_bias":
            if not isinstance(value, dict):
                raise RequestError("body.logit_bias must be an object {token id: bias}")
            put("logit_bias", value, name)  # "123" keys read as ints by the sampling model
        elif name == "stream":
            if value:
                raise RequestError("body.stream: true has no meaning in a batch file")
        elif name == "echo" and not chat:
            if value:
                raise RequestError("body.echo: true is not supported (the prompt is not repeated in the text)")
        elif name == "best_of" and not chat:
            if value != body.get("n", 1):
                raise RequestError("body.best_of: only best_of equal to n (no ranking of extra samples)")
        elif name == "logprobs" and not chat:
            if isinstance(value, bool):  # legacy completions: an int K, or null
                if value:
                    raise RequestError("body.logprobs: the completions API takes the number of top logprobs (0-20)")
            else:
                put("logprobs", value, name)
        elif name == "logprobs" and chat:
            if not isinstance(value, bool):
                raise RequestError(f"body.logprobs must be true or false, got {value!r}")
            if value:
                top = body.get("top_logprobs")
                put("logprobs", 0 if top is None else top, name)
        elif name == "top_logprobs" and chat:
            if not body.get("logprobs"):
                raise RequestError("body.top_logprobs needs body.logprobs: true")
        elif name == "response_format" and chat:
            _response_format(value, put)
        elif name == "chat_template_kwargs" and chat:
            put("chat_template_kwargs", value, name)
        elif name == "tools" and chat:
            out["tools"] = value
        else:
            raise RequestError(f"body.{name}: not supported by dflash-batch (no such setting here)")
    out["sampling"], out["origin"] = sampling, origin
    return out


def _response_format(value: Any, put) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        put("json_schema", {"type": "object"}, "response_format")
    elif kind == "json_schema" and isinstance(value.get("json_schema"), dict) and "schema" in value["json_schema"]:
        put("json_schema", value["json_schema"]["schema"], "response_format")
    else:
        raise RequestError("body.response_format: must be {type: text}, {type: json_object} or "
                           "{type: json_schema, json_schema: {schema: ...}}")


# error_type values that are the engine's failure, not the request's (HTTP 500, not 400)
_SERVER_ERRORS = ("non_finite_logits", "grammar_error", "out_of_memory", "engine_")


Token = Callable[[int], tuple[str, bytes]]  # a token id's text and bytes (logprobs)


def response_line(samples: list[dict], default_url: str, default_model: str, created: int, token: Token) -> bytes:
    """The output line of one request from its samples' output rows (sample_index order): the
    choices and usage, or, when a sample failed, the error of the first that did."""
    first = samples[0]
    custom_id, url = first["row_id"], first.get("url") or default_url
    request = f"{hash64(custom_id):016x}"
    failed = next((s for s in samples if s["status"] != "ok"), None)
    if failed is not None:
        status = 500 if failed["error_type"].startswith(_SERVER_ERRORS) else 400
        where = f"sample {failed['sample_index']}: " if len(samples) > 1 else ""
        body = {"error": {"message": f"{where}{failed['error']}", "type": "invalid_request_error" if status == 400
                          else "server_error", "param": None, "code": failed["error_type"]}}
    else:
        chat = url == CHAT_URL
        choices = [_chat_choice(s, token) if chat else _text_choice(s, token) for s in samples]
        completion = sum(s["completion_tokens"] for s in samples)
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request}",
                "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": first.get("model") or default_model, "choices": choices,
                "usage": {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
                          "total_tokens": first["prompt_tokens"] + completion,
                          "prompt_tokens_details": {"cached_tokens": first["cached_tokens"]}},
                "system_fingerprint": first["config_hash"]}
        status = 200
    line = {"id": f"batch_req_{request}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{request}", "body": body}, "error": None}
    return orjson.dumps(line) + b"\n"


def _finish(s: dict) -> str:
    return "length" if s["finish_reason"] == "length" else "stop"


def _ids(s: dict) -> list[int]:
    if s.get("response_token_ids") is None:
        raise RequestError(f"row {s['row_id']!r} has logprobs but no response_token_ids (a run before dflash-batch "
                           "wrote them with logprobs): rerun it with output.include_token_ids: true")
    return s["response_token_ids"]


def _chat_choice(s: dict, token: Token) -> dict:
    message = {"role": "assistant", "content": s["response"]}
    if s.get("reasoning") is not None:
        message["reasoning_content"] = s["reasoning"]
    logprobs = None
    if s.get("logprobs") is not None:
        def entry(t: int, lp: float) -> dict:
            text, raw = token(t)
            return {"token": text, "logprob": lp, "bytes": list(raw)}
        logprobs = {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(ids, top)]}
                                for t, lp, ids, top in zip(_ids(s), s["logprobs"],
                                                           s["top_logprob_ids"], s["top_logprobs"])]}
    choice = {"index": s["sample_index"], "message": message, "logprobs": logprobs, "finish_reason": _finish(s)}
    if s.get("conversation") is not None:  # a conversation: all of it, the request's messages first, this message last
        choice["conversation"] = orjson.loads(s["conversation"])
    return choice


def _text_choice(s: dict, token: Token) -> dict:
    logprobs = None
    if s.get("logprobs") is not None:
        texts = [token(t)[0] for t in _ids(s)]
        offsets = list(accumulate((len(t) for t in texts[:-1]), initial=0)) if texts else []
        logprobs = {"tokens": texts, "token_logprobs": s["logprobs"], "text_offset": offsets,
                    "top_logprobs": [{token(i)[0]: v for i, v in zip(ids, top)}
                                     for ids, top in zip(s["top_logprob_ids"], s["top_logprobs"])]}
    choice = {"index": s["sample_index"], "text": s["response"] or "", "logprobs": logprobs,
              "finish_reason": _finish(s)}
    if s.get("reasoning") is not None:  # output.split_reasoning: the answer is `text`
        choice["reasoning_content"] = s["reasoning"]
    return choice

"""The OpenAI wire protocol: request bodies as pydantic models (strict JSON types),
the response, chunk and error shapes. Our extensions are marked "extension".

Types are checked here (strict: "5" is not an integer, true is not a number);
values that follow the engine's own rules (sampling, SnapKV settings, KV dtype)
are checked where the job is built (engine/serve/jobs.py), by the same code the
command line uses.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# Extension: per-request SnapKV settings, body field -> Settings field (config.py).
KV_FIELDS = {
    "kv_budget": "snapkv_budget",          # rows kept per layer; 0 = no eviction for this request
    "kv_window": "snapkv_window",
    "kv_recency": "snapkv_recency",
    "kv_sinks": "snapkv_sinks",
    "kv_kernel": "snapkv_kernel",
    "kv_pool": "snapkv_pool",
    "kv_granularity": "snapkv_granularity",
    "kv_min_tokens": "snapkv_min_tokens",
    "kv_merge": "snapkv_merge",
    "kv_allocation": "snapkv_allocation",
    "kv_pyramid_beta": "snapkv_pyramid_beta",
}


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do (clients send many),
    # except misspelt `kv_*` extensions and sampling fields other servers implement and this
    # one does not (min_p, repetition_penalty, ...) set to anything but their no-op value,
    # which are refused (jobs.py).
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)     # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)                                     # extension; 0 = off
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                                        # extension (as vLLM, llama.cpp)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extension: this request's eviction policy and KV row format
    kv_budget: int | None = None
    kv_window: int | None = None
    kv_recency: int | None = None
    kv_sinks: int | None = None
    kv_kernel: int | None = None
    kv_pool: str | None = None
    kv_granularity: str | None = None
    kv_min_tokens: int | None = None
    kv_merge: int | None = None
    kv_allocation: str | None = None
    kv_pyramid_beta: int | None = None
    kv_dtype: str | None = None
    response_format: ResponseFormat | None = None                  # constrained output (engine/grammar.py)


TokenIds = list[int]


class CompletionRequest(_Common):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: int | None = Field(16, ge=0)          # OpenAI's default; 0 with echo: score the prompt
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict = "{}"                   # OpenAI sends a JSON string; a dict is taken too


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None        # an assistant's earlier calls
    tool_call_id: str | None = None                 # role "tool": the call this answers


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None                  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`text`, `json_object` (any JSON object) or `json_schema` (its schema, strict or not)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)          # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """POST /tokenize, vLLM's fields (prompt or messages, add_special_tokens) and llama.cpp's
    (content, add_special)."""
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_special: bool | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids -> text."""
    model: str | None = None
    tokens: TokenIds


# -- responses ---------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion(rid: str, model: str, created: int, text: str, finish_reason: str, usage: dict,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_completion(rid: str, model: str, created: int, text: str | None, finish_reason: str, usage: dict,
                    logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage}


def tool_call(name: str, arguments: str) -> dict:
    """One parsed call in OpenAI's shape (arguments: a JSON string)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_deltas(calls: list[dict]) -> dict:
    """A stream's delta carrying whole calls (index added, as OpenAI's chunks have it)."""
    return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


# -- logprobs: Sequence's TokenLogprob entries (id, text offset, logprob, top) in OpenAI's shapes --
def _token_text(data: bytes) -> str:
    """A token's text; a token that is part of a UTF-8 character (a byte token) as
    "bytes:\\xe4\\xbd" as OpenAI writes it, so distinct tokens keep distinct keys in
    top_logprobs and a client can rebuild the bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def completion_logprobs(entries, token_bytes) -> dict:
    """The completions API's object: tokens, token_logprobs, top_logprobs (dicts by token
    text; null for an echoed prompt's first token) and text_offset (where each token's
    text starts in the choice's text)."""
    return {"tokens": [_token_text(token_bytes(tid)) for tid, _, _, _ in entries],
            "token_logprobs": [lp for _, _, lp, _ in entries],
            "top_logprobs": [None if top is None else {_token_text(token_bytes(i)): lp for i, lp in top}
                             for _, _, _, top in entries],
            "text_offset": [offset for _, offset, _, _ in entries]}


def chat_logprobs(entries, token_bytes) -> dict:
    """The chat API's object: content = [{token, logprob, bytes, top_logprobs}]."""
    def item(tid: int, lp: float) -> dict:
        data = token_bytes(tid)
        return {"token": _token_text(data), "logprob": lp, "bytes": list(data)}
    return {"content": [{**item(tid, lp), "top_logprobs": [item(i, l) for i, l in top]}
                        for tid, _, lp, top in entries],
            "refusal": None}


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "snapkv-engine"}]}


def error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def now() -> int:
    return int(time.time())


class ApiError(Exception):
    """An error answered as OpenAI's JSON: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
             408: "invalid_request_error", 413: "invalid_request_error", 421: "invalid_request_error",
             503: "server_overloaded", 500: "server_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers                  # sent with the JSON answer (Retry-After)

    def body(self) -> dict:
        return error(self.message, self.TYPES.get(self.status, "server_error"), self.param, self.code)

"""A validated request body -> a Job: prompt token ids, sampling, the request's
eviction policy and KV row format. Values are checked by the engine's own rules
(SamplingParams, the settings' parsers, SnapKV's check_values), so a request is
refused exactly where `engine run` with the same values would be; every refusal
is an ApiError(400) naming the body field.

Runs in a thread of the HTTP layer (tokenizing a long prompt takes a while), not
on the event loop and not on the model's worker.
"""
from __future__ import annotations

import dataclasses

from .. import config as config_mod
from .. import inputs
from ..errors import EngineError
from ..generate import SamplingParams
from ..model import kv_dtypes_for
from ..snapkv import SnapKvConfig, check_values
from .protocol import KV_FIELDS, ApiError, ChatCompletionRequest, CompletionRequest
from .sequence import Job

MAX_TOP_LOGPROBS = 20      # alternatives per token (OpenAI's chat limit; vLLM's default)
SNAPKV_KEYS = ("budget", "window", "sinks", "recency", "kernel", "pool", "granularity", "min_tokens", "merge",
               "allocation", "pyramid_beta")


def completion_job(model, req: CompletionRequest) -> Job:
    _check_supported(req)
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of must be 1: one choice per request is supported", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
    ids = _completion_ids(model, req.prompt)
    return _job(model, req, ids, req.max_tokens, _top_logprobs(req.logprobs, "logprobs"), echo=req.echo)


def chat_job(model, req: ChatCompletionRequest) -> Job:
    _check_supported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.tools:
        raise ApiError(400, "tools are not supported", "tools")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "response_format other than text is not supported", "response_format")
    ids = _checked_ids(model, _chat_ids(model, req.messages), "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = _top_logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
    return _job(model, req, ids, max_tokens, logprobs)


def tokenize(model, req) -> list[int]:
    """/tokenize: `prompt` or `content` (text, special tokens added unless
    add_special_tokens / add_special is false) or `messages` (rendered by the chat
    template, as chat requests are) -> token ids."""
    given = [name for name in ("prompt", "content", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of prompt, content (text) or messages (a chat)", "prompt")
    if req.messages is not None:
        return _chat_ids(model, req.messages)
    add = req.add_special_tokens if req.add_special_tokens is not None else req.add_special
    try:
        return model.tokenize(getattr(req, given[0]), add_bos=False if add is False else None)
    except EngineError as e:
        raise ApiError(400, str(e), given[0]) from None


def detokenize(model, req) -> str:
    try:
        return model.detokenize(req.tokens)
    except EngineError as e:
        raise ApiError(400, str(e), "tokens") from None


# -- parts ---------------------------------------------------------------------------------------
def _check_supported(req) -> None:
    if req.n != 1:
        raise ApiError(400, f"n must be 1: one choice per request is supported, got {req.n}", "n")
    unknown = sorted(k for k in (req.model_extra or {}) if k.startswith("kv_"))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}: the KV fields are "
                       f"{', '.join(list(KV_FIELDS) + ['kv_dtype'])}", unknown[0])


def _chat_ids(model, chat_messages) -> list[int]:
    """Chat messages rendered by the GGUF's chat template -> token ids."""
    messages = []
    for m in chat_messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        messages.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    try:
        text = model.render_chat(messages)
    except EngineError as e:
        raise ApiError(400, str(e), "messages") from None
    return _encode(model, text, "messages")


def _completion_ids(model, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = _encode(model, prompt, "prompt")
    else:
        try:
            ids = inputs.token_ids(prompt, model.config.vocab_size, "prompt token ids")
        except EngineError as e:
            raise ApiError(400, str(e), "prompt") from None
    return _checked_ids(model, ids, "prompt")


def _encode(model, text: str, param: str) -> list[int]:
    """Text -> ids the way Model.generate tokenizes a prompt."""
    try:
        return model.tokenizer.encode(inputs.text(text, param))
    except EngineError as e:
        raise ApiError(400, str(e), param) from None


def _checked_ids(model, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise ApiError(400, "the prompt is empty: give at least one token", param)
    if len(ids) > model.ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the context is {model.ctx} tokens "
                       f"(the server's --ctx)", param, "context_length_exceeded")
    return ids


def _top_logprobs(k: int | None, param: str) -> int | None:
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", param)
    return k


def _job(model, req, ids: list[int], max_tokens: int | None, logprobs: int | None, echo: bool = False) -> Job:
    if max_tokens is None:                       # chat's default: until the context is full
        max_tokens = max(model.ctx - len(ids), 1)
    try:
        stop = inputs.stop_strings(req.stop)
        bias = inputs.logit_bias(req.logit_bias, model.config.vocab_size)
        params = SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_k=req.top_k,
                                top_p=float(req.top_p), seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
                                presence_penalty=float(req.presence_penalty),
                                frequency_penalty=float(req.frequency_penalty), logit_bias=bias)
    except EngineError as e:
        raise ApiError(400, str(e), _param_of(str(e), "stop")) from None
    kv_dtype = None
    if req.kv_dtype is not None:
        try:
            kv_dtype = config_mod.parse_setting("kv_dtype", req.kv_dtype, "kv_dtype")
            kv_dtypes_for(kv_dtype, model.backend, model.config)
        except EngineError as e:
            raise ApiError(400, str(e), "kv_dtype") from None
    return Job(ids=ids, params=params, snapkv=snapkv_policy(model, req), kv_dtype=kv_dtype, logprobs=logprobs,
               echo=echo)


def _param_of(message: str, default: str) -> str:
    first = message.split(" ", 1)[0]
    first = first.rstrip(":")
    return first if first in ("max_tokens", "temperature", "top_k", "top_p", "seed", "presence_penalty",
                              "frequency_penalty", "logit_bias") else default


def snapkv_policy(model, req) -> SnapKvConfig | None:
    """The request's eviction policy: the server's (`model.snapkv`, from its flags,
    env and auto policy) with the request's kv_* fields over it. kv_budget 0 turns
    eviction off; other fields alone tune the server's policy (and are checked even
    when eviction is off, as the flags are)."""
    given = {name: getattr(req, name) for name in KV_FIELDS if getattr(req, name) is not None}
    if not given:
        return model.snapkv
    if model.snapkv is not None:
        values = dataclasses.asdict(model.snapkv)
    else:
        s = model.settings
        values = {k: getattr(s, f"snapkv_{k}") for k in SNAPKV_KEYS}
        values["budget"] = 0
    for name, value in given.items():
        try:
            values[KV_FIELDS[name].removeprefix("snapkv_")] = config_mod.parse_setting(KV_FIELDS[name], value, name)
        except EngineError as e:
            raise ApiError(400, str(e), name) from None
    if not values["budget"]:
        return None
    try:
        check_values(values, {k: f"kv_{k}" for k in SNAPKV_KEYS})
        return SnapKvConfig(**values)
    except EngineError as e:
        raise ApiError(400, str(e), "kv_budget") from None

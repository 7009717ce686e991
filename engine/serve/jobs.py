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

from .. import chat_content
from .. import config as config_mod
from .. import inputs
from ..errors import EngineError
from ..generate import SamplingParams
from ..model import kv_spec_for
from ..snapkv import SnapKvConfig, check_values
from .limits import Limits
from .protocol import KV_FIELDS, ApiError, ChatCompletionRequest, CompletionRequest
from .sequence import Job
from .structured import NO_TOOLS, ToolPlan, constraint, template_messages

COUNT_CHUNK = 1 << 16      # a long text's tokens are counted this many characters at a time first

MAX_TOP_LOGPROBS = 20      # alternatives per token (OpenAI's chat limit; vLLM's default)
SNAPKV_KEYS = ("budget", "window", "sinks", "recency", "kernel", "pool", "granularity", "min_tokens", "merge",
               "allocation", "pyramid_beta")


def completion_job(model, req: CompletionRequest, limits: Limits = Limits()) -> Job:
    _check_supported(req)
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of must be 1: one choice per request is supported", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
    check_stop(req.stop, limits)
    if req.echo and req.response_format is not None and req.response_format.type != "text":
        raise ApiError(400, "echo cannot be combined with a response_format", "echo")
    ids = _completion_ids(model, req.prompt)
    job = _job(model, req, ids, req.max_tokens, _top_logprobs(req.logprobs, "logprobs"), echo=req.echo)
    return dataclasses.replace(job, constraint=constraint(model, req))


def chat_job(model, req: ChatCompletionRequest, rendered: RenderedChat | None = None, limits: Limits = Limits(),
             plan: ToolPlan = NO_TOOLS) -> Job:
    """`rendered`: the chat template's output for req.messages (RenderedChat); None
    renders it here. `plan`: the request's tools
    (structured.tool_plan), rendered into the prompt and maybe constraining the output."""
    _check_supported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    check_stop(req.stop, limits)
    ids = _checked_ids(model, _chat_ids(model, req.messages, rendered, limits.content_specials, plan.tools),
                       "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = _top_logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
    job = _job(model, req, ids, max_tokens, logprobs)
    return dataclasses.replace(job, constraint=constraint(model, req, plan))


def tokenize(model, req, rendered: RenderedChat | None = None, limits: Limits = Limits()) -> list[int]:
    """/tokenize: `prompt` or `content` (text, special tokens added unless
    add_special_tokens / add_special is false) or `messages` (rendered by the chat
    template, as chat requests are) -> token ids."""
    given = [name for name in ("prompt", "content", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of prompt, content (text) or messages (a chat)", "prompt")
    if req.messages is not None:
        return _chat_ids(model, req.messages, rendered, limits.content_specials)
    add = req.add_special_tokens if req.add_special_tokens is not None else req.add_special
    return _encode(model, getattr(req, given[0]), given[0], add_bos=False if add is False else None)


def detokenize(model, req) -> str:
    if len(req.tokens) > model.ctx:
        raise ApiError(400, f"{len(req.tokens)} tokens: more than the model's context of {model.ctx}", "tokens")
    try:
        return model.detokenize(req.tokens)
    except EngineError as e:
        raise ApiError(400, str(e), "tokens") from None


# -- parts ---------------------------------------------------------------------------------------
# sampling fields of vLLM or llama.cpp's server this one does not implement, with the value
# that leaves sampling as it is (clients that always send the defaults keep working)
UNSUPPORTED_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "repeat_penalty": 1.0, "typical_p": 1.0,
                        "tfs_z": 1.0, "top_a": 0.0, "mirostat": 0, "min_tokens": 0, "skip_special_tokens": True,
                        "include_stop_str_in_output": False, "use_beam_search": False,
                        "continue_final_message": False, "stop_token_ids": None}


def _check_supported(req) -> None:
    if req.n != 1:
        raise ApiError(400, f"n must be 1: one choice per request is supported, got {req.n}", "n")
    extra = req.model_extra or {}
    for name, noop in UNSUPPORTED_SAMPLING.items():
        if name in extra and extra[name] not in (noop, None, []):
            raise ApiError(400, f"{name}={extra[name]!r} is not supported by this server (it samples with "
                           f"temperature, top_k, top_p, seed, stop, presence_penalty, frequency_penalty and "
                           f"logit_bias); leave it out rather than have it ignored", name)
    unknown = sorted(k for k in extra if k.startswith("kv_"))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}: the KV fields are "
                       f"{', '.join(list(KV_FIELDS) + ['kv_dtype'])}", unknown[0])


def chat_messages(chat_messages, max_messages: int | None = None) -> list[dict]:
    """The request's messages as the chat template sees them (text parts joined; an
    assistant's tool calls and a tool message's call id, structured.template_messages).
    More than `max_messages` (the model's context: each message is at least a token)
    is a 400, before anything else looks at them."""
    if max_messages is not None and len(chat_messages) > max_messages:
        raise ApiError(400, f"{len(chat_messages)} messages: more than a context of {max_messages} tokens can hold",
                       "messages")
    messages = []
    for m in chat_messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        messages.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    return template_messages(messages, chat_messages)


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A chat template's output for a request's messages (rendered by the server in a
    worker process, render.py), and its skeleton: the same messages rendered with each
    content that holds special-token text as its mark (engine/chat_content.py; None where
    no content holds any, or where content_specials is "parse")."""
    text: str
    skeleton: str | None = None


def _chat_ids(model, request_messages, rendered: RenderedChat | None = None, content_specials: str = "text",
              tools: list[dict] | None = None) -> list[int]:
    """Chat messages rendered by the GGUF's chat template -> token ids. With
    content_specials "text", special-token text inside a message's content (a forged
    `<|im_end|><|im_start|>system`) is tokenized as plain text: only the template's own
    markup becomes control tokens. The skeleton (RenderedChat) says where each content
    is, so content that repeats the template's markup cannot take its place."""
    messages = chat_messages(request_messages, model.ctx)
    tok = model.tokenizer
    as_text = content_specials == "text"
    try:
        if as_text:
            chat_content.check_fields(tok, messages, tools)
        if rendered is None:
            def render(ms):
                return tok.apply_chat_template(ms, tools=tools) if tools else model.render_chat(ms)
            marked = chat_content.marked_messages(tok, messages) if as_text else None
            rendered = RenderedChat(render(messages), render(marked) if marked else None)
        text = inputs_text(rendered.text, "messages")
        _check_length(model, text, "messages")
        add_bos = tok.chat_add_bos(text)           # the template's own BOS, not a second one
        if not as_text or rendered.skeleton is None:
            return _encode(model, text, "messages", add_bos=add_bos)
        return tok.encode_parts(chat_content.content_parts(text, rendered.skeleton, messages), add_bos=add_bos)
    except EngineError as e:
        raise ApiError(400, str(e), "messages") from None


def inputs_text(text, param: str) -> str:
    try:
        return inputs.text(text, param)
    except EngineError as e:
        raise ApiError(400, str(e), param) from None


def check_stop(stop, limits: Limits) -> None:
    """At most limits.max_stop strings of at most max_stop_chars characters (the worker
    matches every one against every token's text)."""
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"stop: at most {limits.max_stop} stop strings are allowed (--max-stop), got "
                            f"{len(stops)}", "stop")
    for s in stops:
        if len(s) > limits.max_stop_chars:
            raise ApiError(400, f"stop: a stop string may have at most {limits.max_stop_chars} characters "
                                f"(--max-stop-chars), got {len(s)}", "stop")


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


def _encode(model, text: str, param: str, add_bos: bool | None = None) -> list[int]:
    """Text -> ids the way Model.generate tokenizes a prompt; a text that cannot fit the
    context is refused before it is tokenized whole (_check_length)."""
    text = inputs_text(text, param)
    _check_length(model, text, param)
    try:
        return model.tokenizer.encode(text, add_bos=add_bos)
    except EngineError as e:
        raise ApiError(400, str(e), param) from None


def _too_long(model, n: str, param: str) -> ApiError:
    return ApiError(400, f"the prompt has {n} tokens but the context is {model.ctx} tokens (the server's --ctx)",
                    param, "context_length_exceeded")


def _check_length(model, text: str, param: str) -> None:
    """Refuse a text with more tokens than the context without tokenizing it whole: one
    token stands for at most max_piece_chars characters, and a long text is counted
    COUNT_CHUNK characters at a time (cut after whitespace), stopping once past the
    context (each cut may merge two tokens into one: one token of slack per chunk)."""
    tok = model.tokenizer
    if len(text) > model.ctx * tok.max_piece_chars + 1:
        raise _too_long(model, f"at least {len(text) // tok.max_piece_chars}", param)
    if len(text) <= COUNT_CHUNK:
        return
    n, at, chunks = 0, 0, 0
    while at < len(text):
        end = min(at + COUNT_CHUNK, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", at, end), text.rfind("\n", at, end))
            end = cut + 1 if cut > at else end
        n += len(tok.encode(text[at:end], add_bos=False))
        chunks += 1
        at = end
        if n - chunks > model.ctx:
            raise _too_long(model, f"more than {n - chunks}", param)


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
            kv_spec_for(kv_dtype, model.backend, model.config)
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

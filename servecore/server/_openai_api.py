"""The OpenAI API's shapes: ``/v1/chat/completions`` and ``/v1/completions`` requests read into
an ``Ask``, and the objects and chunks they answer with.

Fields read: ``model``, ``messages`` / ``prompt`` (text, a list of texts, token ids, a list of
token-id lists), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``n``, ``stream``, ``stream_options.include_usage``. Fields the
server does not implement (``tools``, ``response_format`` other than text, penalties,
``logit_bias``, ...) are accepted only at their defaults; any other field is a 400 naming it.
``logprobs`` (chat: ``logprobs`` and ``top_logprobs`` up to 20; completions: ``logprobs`` up
to 5) gives each token's log-probability and its most likely alternatives'.

>>> from servecore.testing import word_tokenizer
>>> ask = parse_completion({"model": "m", "prompt": "w7 w8", "max_tokens": 3, "n": 2},
...                        word_tokenizer(32), vocab_size=32)
>>> ask.prompts, ask.n, ask.max_tokens
([[7, 8]], 2, 3)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from servecore.prompts import encode_prompt
from servecore.server._errors import APIError
from servecore.server._fields import Fields, text_parts
from servecore.server._generation import Ask, Usage

__all__ = ["parse_chat", "parse_completion"]

MAX_N = 16
MAX_CHOICES = 64  # prompts x n in one call
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # the completions API's logprobs
MAX_STOP = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _common(f: Fields, ask: Ask, max_tokens: int) -> Ask:
    """The sampling, stopping and streaming fields both routes share, into ``ask``."""
    ask.max_tokens_given = ask.max_tokens_given or f.has("max_tokens")
    ask.max_tokens = f.integer("max_tokens", max_tokens, lo=1)
    ask.temperature = f.number("temperature", 1.0, lo=0.0, hi=2.0)
    ask.top_p = f.number("top_p", 1.0, lo=0.0, hi=1.0)
    if ask.top_p == 0.0:
        raise f.fail("top_p", "top_p must be > 0 (it keeps the most likely tokens whose "
                     "probabilities sum to top_p)")
    ask.top_k = f.integer("top_k", 0, lo=-1, hi=2**31 - 1)
    ask.top_k = max(ask.top_k, 0)
    ask.seed = f.integer("seed", None, lo=-(2**63), hi=2**63 - 1)
    if ask.seed is not None:
        ask.seed %= 2**31  # the engines' seeds are int32
    ask.n = f.integer("n", 1, lo=1, hi=MAX_N)
    ask.stop = f.strings("stop", most=MAX_STOP)
    ask.stream = f.boolean("stream", False)
    options = f.get("stream_options")
    if options is not None:
        if not ask.stream:
            raise f.fail("stream_options", "stream_options is only allowed with stream=true")
        o = Fields(options, "stream_options", prefix="stream_options.")
        ask.include_usage = o.boolean("include_usage", False)
        o.ignored("include_obfuscation")
        o.finish()
    for name, defaults in (("frequency_penalty", (0, 0.0)), ("presence_penalty", (0, 0.0)),
                           ("logit_bias", ({},)), ("tools", ([],)), ("functions", ([],)),
                           ("tool_choice", ("none",)), ("function_call", ("none",)),
                           ("response_format", ({"type": "text"},)),
                           ("parallel_tool_calls", (True, False)), ("best_of", (1,)),
                           ("echo", (False,)), ("suffix", ("",)), ("audio", ()),
                           ("modalities", (["text"],)), ("prediction", ()),
                           ("reasoning_effort", ()), ("service_tier", ("auto", "default")),
                           ("store", (False,)), ("min_p", (0, 0.0)),
                           ("repetition_penalty", (1, 1.0))):
        f.unsupported(name, *defaults)
    f.ignored("user", "metadata")
    return ask


def parse_chat(body: Any, tokenizer: Any, *, vocab_size: int, max_tokens: int = 256) -> Ask:
    """A ``/v1/chat/completions`` body as an ``Ask`` (the messages through the tokenizer's
    chat template); 400 naming the field when it is wrong.

    >>> from servecore.testing import word_tokenizer
    >>> body = {"model": "m", "messages": [{"role": "user", "content": "w7"}], "seed": 3}
    >>> ask = parse_chat(body, word_tokenizer(32), vocab_size=32)
    >>> ask.seed, ask.prompt_field
    (3, 'messages')
    >>> try:
    ...     parse_chat({**body, "presence_penalty": 1}, word_tokenizer(32), vocab_size=32)
    ... except APIError as e:
    ...     print(e.status, e.param)
    400 presence_penalty
    """
    f = Fields(body)
    f.string("model", required=True)
    messages = f.required("messages")
    if not isinstance(messages, list) or not messages:
        raise f.fail("messages", "messages must be a non-empty list of messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    tokens = _encode("messages", chat, tokenizer, vocab_size)
    if f.has("max_completion_tokens"):
        if f.has("max_tokens"):
            raise f.fail("max_tokens", "give max_tokens or max_completion_tokens, not both")
        max_tokens = f.integer("max_completion_tokens", max_tokens, lo=1)
    f.seen.add("max_completion_tokens")
    ask = _common(f, Ask([tokens], prompt_field="messages",
                         max_tokens_given=f.has("max_completion_tokens")), max_tokens)
    top = f.integer("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if f.boolean("logprobs", False):
        ask.logprobs = top or 0
    elif top:
        raise f.fail("top_logprobs", "top_logprobs needs logprobs=true")
    f.finish()
    return ask


def _message(m: Any, i: int) -> dict[str, str]:
    """One chat message as ``{"role", "content"}`` (content parts of type text joined)."""
    f = Fields(m, f"messages[{i}]", prefix=f"messages[{i}].")
    role = f.string("role", required=True)
    if role not in ROLES:
        raise f.fail("role", f"messages[{i}].role must be one of {sorted(ROLES)}, not "
                     f"{role!r} (tool messages need tools, which this server does not serve)")
    content = text_parts(f.required("content"), f"messages[{i}].content")
    f.ignored("name", "refusal", "annotations", "audio")  # a reply sent back as it came
    f.unsupported("tool_calls", [])
    f.unsupported("function_call")
    f.finish()
    return {"role": ROLES[role], "content": content}


def _encode(name: str, prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    try:
        tokens = encode_prompt(name, prompt, tokenizer, vocab_size)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=name) from None
    if not tokens:
        raise APIError(400, f"{name} encodes to no tokens", param=name)
    return tokens


def parse_completion(body: Any, tokenizer: Any, *, vocab_size: int,
                     max_tokens: int = 16) -> Ask:
    """A ``/v1/completions`` body as an ``Ask``: the prompt is a text, a list of texts, a
    list of token ids or a list of such lists.

    >>> from servecore.testing import word_tokenizer
    >>> parse_completion({"model": "m", "prompt": [[7, 8], [9]]}, word_tokenizer(32),
    ...                  vocab_size=32).prompts
    [[7, 8], [9]]
    """
    f = Fields(body)
    f.string("model", required=True)
    prompt = f.required("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise f.fail("prompt", "prompt must be a string, a list of strings, a list of token "
                     "ids or a list of token-id lists, and not empty")
    prompts = []
    for p in prompt:
        if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
            raise f.fail("prompt", "a token-id prompt must be a list of integers")
        prompts.append(_encode("prompt", p, tokenizer, vocab_size))
    ask = _common(f, Ask(prompts, max_tokens_given=False), max_tokens)
    if ask.num_choices > MAX_CHOICES:
        raise f.fail("prompt", f"{len(prompts)} prompts x n={ask.n} asks for "
                     f"{ask.num_choices} answers, more than {MAX_CHOICES} in one call")
    ask.logprobs = f.integer("logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    f.finish()
    return ask


def usage_object(u: Usage) -> dict[str, Any]:
    """OpenAI's ``usage``, ``prompt_tokens_details.cached_tokens`` included (0 on a miss)."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def new_id(kind: str) -> str:
    """A fresh response id (``chatcmpl-...``, ``cmpl-...``)."""
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def chat_logprobs(entries: Sequence[tuple[int, Any]], text_of: Callable[[int], str]
                  ) -> dict[str, Any]:
    """Chat's ``logprobs`` object of ``(token id, TokenLogprobs)`` entries (``text_of``: a
    token's text).

    >>> from servecore.engine import TokenLogprobs
    >>> lp = chat_logprobs([(5, TokenLogprobs(-0.25, ((5, -0.25),)))], lambda t: f"w{t}")
    >>> lp["content"][0]["token"], lp["content"][0]["top_logprobs"][0]["logprob"]
    ('w5', -0.25)
    """
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(t, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}
                        for t, lp in entries], "refusal": None}


def completion_logprobs(entries: Sequence[tuple[int, Any]], text_of: Callable[[int], str],
                        offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs`` object (``offset``: where the first token's text
    starts in the choice's text).

    >>> from servecore.engine import TokenLogprobs
    >>> lp = completion_logprobs([(5, TokenLogprobs(-0.25, ((5, -0.25),)))], lambda t: f"w{t}")
    >>> lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    (['w5'], [-0.25], [{'w5': -0.25}], [0])
    """
    texts = [text_of(t) for t, _ in entries]
    offsets = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [{text_of(i): v for i, v in lp.top} for _, lp in entries],
            "text_offset": offsets}


def chat_response(rid: str, model: str, texts: list[str], finish: list[str | None],
                  usage: Usage, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """A complete ``chat.completion`` object (``logprobs``: each choice's, or None)."""
    logprobs = logprobs or [None] * len(texts)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t,
                                                 "refusal": None},
                         "logprobs": lp, "finish_reason": f}
                        for i, (t, f, lp) in enumerate(zip(texts, finish, logprobs,
                                                           strict=True))],
            "usage": usage_object(usage)}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict[str, Any],
               finish: str | None = None, usage: Usage | None = None,
               logprobs: Any = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` (``index`` None: the usage chunk, no choices)."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "system_fingerprint": None, "choices": []}
    if index is not None:
        out["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                           "finish_reason": finish}]
    if usage is not None:
        out["usage"] = usage_object(usage)
    return out


def completion_response(rid: str, model: str, texts: list[str], finish: list[str | None],
                        usage: Usage, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """A complete ``text_completion`` object (``logprobs``: each choice's, or None)."""
    logprobs = logprobs or [None] * len(texts)
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                        for i, (t, f, lp) in enumerate(zip(texts, finish, logprobs,
                                                           strict=True))],
            "usage": usage_object(usage)}


def completion_chunk(rid: str, model: str, created: int, index: int | None, text: str = "",
                     finish: str | None = None, usage: Usage | None = None,
                     logprobs: Any = None) -> dict[str, Any]:
    """One streamed ``text_completion`` (``index`` None: the usage chunk, no choices)."""
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                           "model": model, "system_fingerprint": None, "choices": []}
    if index is not None:
        out["choices"] = [{"index": index, "text": text, "logprobs": logprobs,
                           "finish_reason": finish}]
    if usage is not None:
        out["usage"] = usage_object(usage)
    return out

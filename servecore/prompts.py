"""Prompts at the door, for both engines: token ids, text, or a chat, and text back out.

``hybridattn.Engine`` and ``mlxcache.Engine`` take ``prompts``, a list of prompts, and read
each prompt by one rule (this module; neither engine has its own):

* a ``str`` is **text**: encoded with the engine's tokenizer, its special tokens added (a BOS,
  say) unless the text already starts with the tokenizer's BOS token;
* a list (or tuple) of **dicts** is a **chat**, ``[{"role": "user", "content": "..."}, ...]``:
  rendered by the tokenizer's chat template with ``add_generation_prompt=True`` and encoded
  as it is (the template writes whatever special tokens it wants);
* anything else is **token ids**: a list, tuple or 1-D integer array, used as they are.

So ``prompts`` is always a list *of* prompts: ``["hello"]`` is one text prompt,
``[[{"role": "user", "content": "hello"}]]`` one chat, ``[[1, 2, 3]]`` one id prompt. A
flat list of ints or a bare list of messages passed as ``prompts`` is refused with a
``ValueError`` that says to wrap it (``servecore.validate.prompt_list``): guessing would
turn a chat of two messages into two prompts.

Text and chats need a tokenizer (a Hugging Face tokenizer, or mlx-lm's ``TokenizerWrapper``
around one); ``load_tokenizer`` reads a checkpoint directory's. ``decode`` turns generated ids
back into text, leaving out the stop token that ended them. Everything here is plain Python:
transformers is imported by ``load_tokenizer`` alone.

>>> from servecore.testing import word_tokenizer
>>> tok = word_tokenizer(16)                      # the word "w6" is token 6, ...
>>> encode_prompts(["w6 w7", [8, 9], [{"role": "user", "content": "w10"}]], tok, 16)
[[6, 7], [8, 9], [4, 10, 5]]
>>> decode(tok, [6, 7, 1], stop={1})              # 1 is tok's EOS
'w6 w7'
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from servecore.validate import _short, plain_ints, prompt_list, token_ids

__all__ = ["Prompt", "check_text", "check_tokenizer", "decode", "encode_prompt", "encode_prompts",
           "has_chat_template", "is_chat", "load_tokenizer"]

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
"""One prompt: text, token ids (or a 1-D integer array), or a chat (a list of messages)."""


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is a chat: a list or tuple whose first element is a dict (a message).
    Its messages are checked by ``encode_prompt``.

    >>> is_chat([{"role": "user", "content": "hi"}]), is_chat([1, 2]), is_chat("hi")
    (True, False, False)
    """
    return isinstance(prompt, list | tuple) and bool(prompt) and isinstance(prompt[0], Mapping)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` can render a chat: mlx-lm's ``has_chat_template`` where it says
    (it also knows renderers of its own), else a Hugging Face ``chat_template`` that is set.

    >>> from servecore.testing import word_tokenizer
    >>> has_chat_template(word_tokenizer(16)), has_chat_template(word_tokenizer(16, chat=False))
    (True, False)
    """
    said = getattr(tokenizer, "has_chat_template", None)
    if isinstance(said, bool):
        return said
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(name: str, prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """One prompt (text, a chat or token ids; see the module docstring) as a new list of
    token ids in ``[0, vocab_size)``. ``name`` (``"prompt 2"``) starts every error.

    Raises ``ValueError`` naming the prompt: text or a chat without a tokenizer, a chat with
    a tokenizer that has no chat template, a message that is not a dict with a ``"role"``, a
    template that refuses the chat, ids outside the vocabulary (the tokenizer's included).

    >>> from servecore.testing import word_tokenizer
    >>> tok = word_tokenizer(16)
    >>> encode_prompt("prompt 0", "w6 w7", tok, 16), encode_prompt("prompt 1", (6, 7), None, 16)
    ([6, 7], [6, 7])
    >>> encode_prompt("prompt 0", "w6", None, 16)
    Traceback (most recent call last):
    ...
    ValueError: prompt 0 is text but the engine has no tokenizer
    >>> chat = [{"role": "user", "content": "w6"}]
    >>> encode_prompt("prompt 0", chat, word_tokenizer(16, chat=False), 16)
    Traceback (most recent call last):
    ...
    ValueError: prompt 0 is a chat, but the tokenizer has no chat template \
(tokenizer.chat_template is None): give text or token ids, or set tokenizer.chat_template
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{name} is text but the engine has no tokenizer")
        bos = getattr(tokenizer, "bos_token", None)
        # mlx-lm's rule: text that already starts with the BOS token gets no second one
        special = not (isinstance(bos, str) and bos and prompt.startswith(bos))
        ids = tokenizer.encode(prompt, add_special_tokens=special)
        where = f"{name} (as the tokenizer encoded it)"
    elif is_chat(prompt):
        ids = _encode_chat(name, prompt, tokenizer)
        where = f"{name} (as the chat template and the tokenizer encoded it)"
    else:
        ids, where = prompt, name
    if plain_ints(ids, vocab_size) and ids:
        return list(ids)  # a copy: the caller may change theirs while the request waits
    return token_ids(where, ids, vocab_size)


def _encode_chat(name: str, messages: list | tuple, tokenizer: Any) -> list[int]:
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"{name}: message {j} is {_short(m)}, not a dict with a 'role' "
                             "(and its 'content')")
    if tokenizer is None:
        raise ValueError(f"{name} is a chat but the engine has no tokenizer")
    if not has_chat_template(tokenizer):
        raise ValueError(f"{name} is a chat, but the tokenizer has no chat template "
                         "(tokenizer.chat_template is None): give text or token ids, or set "
                         "tokenizer.chat_template")
    try:
        # Rendered to text, then encoded: apply_chat_template(tokenize=True) returns a list
        # in transformers 4 and a BatchEncoding in 5; the text form is the same in both.
        text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja's TemplateError, or the template's raise_exception
        raise ValueError(f"{name}: the tokenizer's chat template refused it: "
                         f"{type(e).__name__}: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompts(prompts: Iterable[Any], tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Every prompt of ``prompts`` (read once: a generator is not read twice) as token ids,
    all checked before any is returned; errors name ``prompt i``. See ``encode_prompt``.

    >>> encode_prompts(([1, 2], [3]), None, vocab_size=4)
    [[1, 2], [3]]
    >>> encode_prompts([[{"role": "user", "content": "hi"}]][0], None, 4)
    Traceback (most recent call last):
    ...
    ValueError: prompts must be a list of prompts, got a list of chat messages \
[{'role': 'user', 'content': 'hi'}]: wrap one chat in a list ([messages])
    """
    return [encode_prompt(f"prompt {i}", p, tokenizer, vocab_size)
            for i, p in enumerate(prompt_list(prompts))]


def check_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as an engine is given it, checked before it is kept: ``None`` (ids only)
    or an object with the ``encode`` and ``decode`` methods this module calls (a Hugging Face
    tokenizer, mlx-lm's ``TokenizerWrapper``). Anything else, a path say, is a ``TypeError``
    naming it, rather than an error deep inside the first text prompt.

    >>> from servecore.testing import word_tokenizer
    >>> tok = word_tokenizer(16)
    >>> check_tokenizer(None), check_tokenizer(tok) is tok
    (None, True)
    >>> check_tokenizer("path/to/tokenizer")
    Traceback (most recent call last):
    ...
    TypeError: tokenizer='path/to/tokenizer' (str) is not a tokenizer: give one with encode \
and decode methods (a Hugging Face tokenizer, or mlx-lm's TokenizerWrapper), e.g. \
servecore.prompts.load_tokenizer(path) for a checkpoint directory's, or None for token ids only
    """
    if tokenizer is None:
        return None
    missing = [m for m in ("encode", "decode") if not callable(getattr(tokenizer, m, None))]
    if missing:
        raise TypeError(f"tokenizer={_short(tokenizer)} ({type(tokenizer).__name__}) is not a "
                        "tokenizer: give one with encode and decode methods (a Hugging Face "
                        "tokenizer, or mlx-lm's TokenizerWrapper), e.g. "
                        "servecore.prompts.load_tokenizer(path) for a checkpoint directory's, "
                        "or None for token ids only")
    return tokenizer


def check_text(text: Any, tokenizer: Any) -> bool:
    """The ``text`` flag of an engine's ``generate``, checked before any work: a bool, and
    ``True`` only with a tokenizer to decode with.

    >>> check_text(False, None)
    False
    >>> check_text(True, None)
    Traceback (most recent call last):
    ...
    ValueError: text=True needs a tokenizer: give the engine one (tokenizer=...)
    """
    if not isinstance(text, bool):
        raise ValueError(f"text={text!r} must be True or False")
    if text and tokenizer is None:
        raise ValueError("text=True needs a tokenizer: give the engine one (tokenizer=...)")
    return text


def decode(tokenizer: Any, tokens: Iterable[int], stop: Iterable[int] = ()) -> str:
    """The text of generated ``tokens``, without the last one when it is in ``stop`` (the
    token that ended the request, an EOS say, is not part of the answer).

    >>> from servecore.testing import word_tokenizer
    >>> tok = word_tokenizer(16)
    >>> decode(tok, [6, 7, 1], stop={1}), decode(tok, [6, 7])
    ('w6 w7', 'w6 w7')
    """
    if tokenizer is None:
        raise ValueError("text needs a tokenizer: give the engine one (tokenizer=...)")
    ids = [int(t) for t in tokens]
    if ids and ids[-1] in set(stop):
        ids.pop()
    return tokenizer.decode(ids)


# Files that make a directory a tokenizer (Hugging Face's fast and slow formats, SentencePiece,
# and tiktoken's, which the released Kimi-Linear uses).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "tiktoken.model", "vocab.json", "spiece.model")
_MISSING = re.compile(r"not found in your environment: (.+?)\. Run")


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The tokenizer a checkpoint directory ships (transformers' ``AutoTokenizer``, local
    files only), or ``None`` when the directory has no tokenizer files: ids only.

    A tokenizer whose class is code in the directory (an ``auto_map`` in
    ``tokenizer_config.json``, as the released Kimi-Linear's ``tokenization_kimi.py``) runs
    that code only with ``trust_remote_code=True``; without it, a ``ValueError`` says so.
    A package that the tokenizer needs and that is not installed (transformers itself, or
    ``tiktoken`` for Kimi-Linear's) is an ``ImportError`` naming it and how to install it.

    >>> import tempfile
    >>> from servecore.testing import save_word_tokenizer
    >>> with tempfile.TemporaryDirectory() as path:
    ...     before = load_tokenizer(path)
    ...     save_word_tokenizer(path, 16)
    ...     tok = load_tokenizer(path)
    >>> before is None, tok.encode("w6 w7"), tok.eos_token_id
    (True, [6, 7], 1)
    """
    path = os.fspath(path)
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code={trust_remote_code!r} must be True or False")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"reading the tokenizer in {path!r} needs transformers, which is not "
                          "installed: pip install transformers", name="transformers") from e
    try:
        return transformers.AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True)
    except ImportError as e:
        names = _MISSING.search(str(e))
        missing = names.group(1) if names else getattr(e, "name", None)
        if not missing:
            raise
        raise ImportError(f"the tokenizer in {path!r} needs {missing}, which is not installed: "
                          f"pip install {missing.replace(',', '')}", name=missing) from e
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"the tokenizer in {path!r} is code that ships with the checkpoint "
                         "(the auto_map of its tokenizer_config.json): read it, then pass "
                         "trust_remote_code=True to run it") from e

"""Chat records: read JSONL, render with the model's own chat template, mark the assistant tokens.

Records (one JSON object per line):

* SFT: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` with at least
  one assistant turn. Every assistant turn is a training target; everything else is context.
* DPO: ``{"prompt": str | [messages], "chosen": str | [assistant messages], "rejected": ...}``.
* GRPO: ``{"messages": [... up to the user turn], "reward": NAME, ...}`` (extra keys go to the reward).

The template is the model's: chat_template.jinja beside tokenizer_config.json (transformers 5 writes
that file, and prefers it, as here), else ``chat_template`` in tokenizer_config.json, or a file named
by ``posttrain.chat_template``. It is rendered with jinja2 in a sandbox, in transformers' environment
(``trim_blocks``, ``lstrip_blocks``, ``{% break %}``/``{% continue %}``, the ``{% generation %}`` block
rendering its body unchanged, ``raise_exception``, ``strftime_now``, ``tojson`` with its options, the
guarded ``dict`` and ``namespace``; ``tools`` and ``documents`` None, the special tokens as variables,
a message's ``reasoning``/``thinking``/``reasoning_content`` under each of the latter two names), so the
text is the one the model was tuned on.

The assistant tokens: for assistant turn ``i`` the template is rendered for ``messages[:i]`` with
the generation prompt and for ``messages[:i+1]``; the characters between the two renderings are
that turn's answer (its content and the end-of-turn text the template writes after it). The whole
conversation is then tokenized once and a token is a target when it starts inside an answer, so
the ids are exactly those of the rendered text. A template whose rendering of a prefix is not a
prefix of the longer rendering cannot be masked this way and is refused.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special-token variables it may use."""

    text: str
    source: str
    variables: dict

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        return _compile(self.text).render(**self.variables, messages=[_with_reasoning_aliases(m) for m in messages],
                                          tools=None, documents=None, add_generation_prompt=add_generation_prompt)


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, the first one preferred


def _with_reasoning_aliases(message):
    """A message with its reasoning (the first of :data:`REASONING_KEYS` it holds, not None) also under
    ``thinking`` and ``reasoning_content``, the names templates read (transformers renders them so)."""
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@functools.lru_cache(maxsize=8)
def _compile(text: str):
    """The jinja2 template of ``text`` in transformers' sandboxed environment (pure: cached by text)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers' marker of the assistant's text (for its
        assistant mask); the body renders unchanged, in its own scope as a call block's does."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    def public(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the underscore attribute {name!r} "
                                                  "on a namespace; rename it")
        return name

    class Namespace(jinja2.utils.Namespace):
        """jinja2's ``namespace()`` without underscore attributes (no way to CPython internals)."""

        def __init__(*args, **kwargs):  # self positional-only, so namespace(self=...) stays an attribute
            attrs = dict(*args[1:], **kwargs)
            for name in attrs:
                public(name)
            jinja2.utils.Namespace.__init__(args[0], attrs)

        def __setitem__(self, name, value):
            jinja2.utils.Namespace.__setitem__(self, public(name), value)

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not parse as Jinja (line {err.lineno}: {err.message})") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class NoChatTemplate(ValueError):
    """Neither the template override nor the tokenizer has a chat template; ``where`` says what was looked at."""

    def __init__(self, message: str, *, where: str):
        super().__init__(message)
        self.where = where


def load_chat_template(tokenizer_dir: str | None, *, override: str | None = None) -> ChatTemplate:
    """The chat template of the tokenizer in ``tokenizer_dir`` (its chat_template.jinja, else its
    tokenizer_config.json's ``chat_template``: transformers' precedence), or the Jinja file ``override``.
    Raises ValueError naming both places and ``posttrain.chat_template`` when there is none."""
    config: dict = {}
    cfg_path = os.path.join(tokenizer_dir, "tokenizer_config.json") if tokenizer_dir else None
    if cfg_path and os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    variables = {name: _token_text(config.get(name)) for name in
                 ("bos_token", "eos_token", "pad_token", "unk_token")}
    if override is not None:
        if not os.path.isfile(override):
            raise ValueError(f"posttrain.chat_template={override!r} does not exist; give a Jinja template file")
        with open(override, encoding="utf-8") as f:
            return ChatTemplate(text=f.read(), source=override, variables=variables)
    jinja_path = os.path.join(tokenizer_dir, "chat_template.jinja") if tokenizer_dir else None
    if jinja_path and os.path.isfile(jinja_path):  # the file wins over the config's entry, as in transformers
        with open(jinja_path, encoding="utf-8") as f:
            text, source = f.read(), jinja_path
    else:
        text, source = config.get("chat_template"), cfg_path
        if isinstance(text, list):  # [{"name": "default", "template": ...}, ...]
            text = next((t.get("template") for t in text if t.get("name") == "default"), None)
    if not text:
        where = f"{cfg_path} has no 'chat_template' and there is no {jinja_path}" if tokenizer_dir \
            else "no tokenizer directory was given"
        raise NoChatTemplate(f"no chat template: {where}. Point posttrain.chat_template at a Jinja template file, or "
                             "use a tokenizer (data.tokenizer, or the checkpoint's hf/ directory) that has one",
                             where=where)
    return ChatTemplate(text=text, source=source, variables=variables)


# -- records --------------------------------------------------------------------------------------------

def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSONL file (blank lines skipped); errors name the file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"posttrain data {path!r} does not exist (resolved to {os.path.abspath(path)})")
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: each line must be a JSON object, got {type(rec).__name__}")
            rec["_where"] = f"{path}:{n}"
            records.append(rec)
    if not records:
        raise ValueError(f"posttrain data {path!r} holds no records")
    return records


def check_messages(messages: Any, *, where: str, need_assistant: bool = True) -> list[dict]:
    """``messages`` as a list of {role, content} dicts; raises naming the record."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be an object with 'role' and a string 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; use one of {ROLES}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the record has no assistant turn, so nothing would be trained on; "
                         "add an {'role': 'assistant', 'content': ...} message or drop the record")
    return messages


def _as_messages(value, *, role: str, where: str, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    try:
        return check_messages(value, where=f"{where} ('{key}')", need_assistant=False)
    except ValueError:
        raise ValueError(f"{where}: '{key}' must be a string or a list of {{'role', 'content'}} messages") from None


def preference_conversations(rec: dict) -> tuple[list[dict], list[dict], int]:
    """(prompt + chosen, prompt + rejected, the prompt's message count) of a DPO record: only the messages from
    that index on are the completions (a multi-turn prompt's own assistant turns are context)."""
    where = rec.get("_where", "record")
    for key in ("prompt", "chosen", "rejected"):
        if key not in rec:
            raise ValueError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; '{key}' is missing")
    prompt = _as_messages(rec["prompt"], role="user", where=where, key="prompt")
    chosen = _as_messages(rec["chosen"], role="assistant", where=where, key="chosen")
    rejected = _as_messages(rec["rejected"], role="assistant", where=where, key="rejected")
    for key, turns in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in turns):
            raise ValueError(f"{where}: '{key}' has no assistant message")
    return prompt + chosen, prompt + rejected, len(prompt)


# -- tokens ---------------------------------------------------------------------------------------------

def _encode_with_starts(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and each token's start offset in characters."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [start for start, _ in enc.offsets]
    ids = tokenizer.encode(text)  # the byte tokenizer: one id per UTF-8 byte
    starts, pos = [], 0
    for ch in text:
        starts += [pos] * len(ch.encode("utf-8"))
        pos += 1
    assert len(starts) == len(ids), "byte tokenizer: one token per byte"
    return ids, starts


def assistant_spans(template: ChatTemplate, messages: Sequence[dict], *, where: str = "record",
                    first_target: int = 0) -> tuple[str, list]:
    """The rendered conversation and the (start, end) character spans of its assistant answers from message
    ``first_target`` on (earlier ones are context, e.g. a preference record's multi-turn prompt)."""
    full = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first_target:
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(f"{where}: the chat template ({template.source}) does not render a conversation's "
                             f"prefix as a prefix of the whole (at message {i}), so the assistant tokens cannot be "
                             "told apart; use a template without such context (posttrain.chat_template)")
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def tokenize_conversation(template: ChatTemplate, tokenizer, messages: Sequence[dict], *,
                          where: str = "record", first_target: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 (n,), target bool (n,)): the rendered conversation's tokens, True on assistant answers (from
    message ``first_target`` on)."""
    text, spans = assistant_spans(template, messages, where=where, first_target=first_target)
    ids, starts = _encode_with_starts(tokenizer, text)
    target = np.zeros(len(ids), dtype=bool)
    st = np.asarray(starts, dtype=np.int64)
    for a, b in spans:
        target |= (st >= a) & (st < b)
    if not target.any():
        raise ValueError(f"{where}: no token of the rendered conversation falls in an assistant answer "
                         "(empty answers?); nothing would be trained on")
    return np.asarray(ids, dtype=np.int64), target


def prompt_ids(template: ChatTemplate, tokenizer, messages: Sequence[dict]) -> list[int]:
    """The token ids that ask the model for the next assistant turn (generation prompt included)."""
    ids, _ = _encode_with_starts(tokenizer, template.render(messages, add_generation_prompt=True))
    return ids

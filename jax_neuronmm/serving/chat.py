"""A checkpoint's chat template, rendered as transformers renders it.

The template is the GGUF file's `tokenizer.chat_template`, or `chat_template` in a checkpoint directory's
tokenizer_config.json (a string, or a list of named templates of which "default" is used). It runs in jinja2's
immutable sandbox with transformers' settings (trim_blocks, lstrip_blocks, the loop-controls extension, `tojson`,
`raise_exception`, `strftime_now`), with the checkpoint's bos_token / eos_token strings; the rendered text is then
tokenized without adding special tokens (the template writes them).
"""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (it raised, or the messages broke it)."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.datetime.now().strftime(format_string)


class ChatTemplate:
    """`render(messages) -> str`: messages are dicts with "role" and "content"."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as error:
            raise ValueError(f"chat_template: not a valid jinja2 template ({error})") from error
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"messages: the chat template refused them ({error})") from error


def _token_string(value) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def load_chat_template(path: str) -> ChatTemplate | None:
    """The chat template of the checkpoint at `path` (a GGUF file or a directory), or None when it has none."""
    if os.path.isfile(path):
        import gguf

        reader = gguf.GGUFReader(path)
        fields = reader.fields
        if "tokenizer.chat_template" not in fields:
            return None
        tokens = fields["tokenizer.ggml.tokens"].contents() if "tokenizer.ggml.tokens" in fields else []

        def token(key):
            index = fields[key].contents() if key in fields else None
            return tokens[index] if index is not None and 0 <= index < len(tokens) else ""

        return ChatTemplate(
            fields["tokenizer.chat_template"].contents(),
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
        )
    config_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    return ChatTemplate(
        source, bos_token=_token_string(config.get("bos_token")), eos_token=_token_string(config.get("eos_token"))
    )

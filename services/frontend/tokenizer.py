"""Tokenizers for the frontend, and incremental detokenization that never
emits half of a multi-byte character."""

from __future__ import annotations

import codecs
import json
import pathlib
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # ids 0 .. vocab_size-1 (what the model accepts may be more: instances say)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            kwargs: dict | None = None) -> list[int]: ...

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> "Detokenizer": ...

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str:
        """Text that became final with this token (may be empty)."""

    def flush(self) -> str:
        """Whatever is held back, at the end of the stream."""


class ByteTokenizer:
    """For fake and sim engines: one token per UTF-8 byte. Token 0 is EOS."""

    eos_token_ids = (0,)
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8")) or [32]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            kwargs: dict | None = None) -> list[int]:
        if chat_template is not None:
            return self.encode(render_template(chat_template, messages, add_generation_prompt, tools, documents,
                                               kwargs))
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        if tools:
            text = f"<tools>{json.dumps(tools)}\n" + text
        if continue_final_message:
            return self.encode(text.rstrip("\n"))
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> "ByteDetokenizer":
        return ByteDetokenizer()

    def token_text(self, token_id: int) -> str:
        return bytes([token_id & 0xFF]).decode("utf-8", errors="replace")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")


class ByteDetokenizer:
    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._dec.decode(bytes([token_id & 0xFF]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a model directory."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        eos = self.tok.eos_token_id
        self.eos_token_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        self.vocab_size = len(self.tok)
        # A model whose template knows no tools (SmolLM2's) gets Ferry's ChatML one when a request has them.
        self.template_knows_tools = "tools" in (self.tok.chat_template or "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens) or [self.tok.eos_token_id or 0]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            kwargs: dict | None = None) -> list[int]:
        with_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if chat_template is None and with_tools and not self.template_knows_tools:
            chat_template = tools_template()
        out = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and not
                                           continue_final_message, continue_final_message=continue_final_message,
                                           tools=tools or None, documents=documents, chat_template=chat_template,
                                           tokenize=True, **(kwargs or {}))
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> "HFDetokenizer":
        return HFDetokenizer(self.tok, prompt_ids, skip_special_tokens=skip_special_tokens,
                             spaces_between_special_tokens=spaces_between_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def tools_template() -> str:
    """Ferry's ChatML template with tools (Hermes' format: the tools in the
    system message, calls as <tool_call> JSON, results as <tool_response>)."""
    return (pathlib.Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()


def render_template(template: str, messages: list[dict], add_generation_prompt: bool, tools, documents,
                    kwargs: dict | None) -> str:
    """A chat template rendered without a tokenizer (the byte tokenizer), in transformers' sandbox."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=template, tools=tools, documents=documents,
                                        add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    return rendered[0]


class HFDetokenizer:
    """Incremental detokenization: decode a short window of recent tokens and
    emit only the new suffix; hold back text ending in U+FFFD (an incomplete
    multi-byte character) until the next token completes it."""

    def __init__(self, tok, prompt_ids: list[int], window: int = 6, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tok = tok
        self.ids: list[int] = list(prompt_ids[-window:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special = skip_special_tokens
        self.spaces = spaces_between_special_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False,
                               spaces_between_special_tokens=self.spaces)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new

    def flush(self) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return full[len(prefix):]


def load_tokenizer(model: str) -> Tokenizer:
    if model in ("fake", "sim"):
        return ByteTokenizer()
    from libs.common.models import ensure_model

    return HFTokenizer(str(ensure_model(model)))

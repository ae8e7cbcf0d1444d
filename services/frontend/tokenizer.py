"""Tokenizers for the frontend, and incremental detokenization that never
emits half of a multi-byte character."""

from __future__ import annotations

import codecs
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # ids 0 .. vocab_size-1 (what the model accepts may be more: instances say)

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    def detokenizer(self, prompt_ids: list[int]) -> "Detokenizer": ...


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str:
        """Text that became final with this token (may be empty)."""

    def flush(self) -> str:
        """Whatever is held back, at the end of the stream."""


class ByteTokenizer:
    """For fake and sim engines: one token per UTF-8 byte. Token 0 is EOS."""

    eos_token_ids = (0,)
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) or [32]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"
        return self.encode(text)

    def detokenizer(self, prompt_ids: list[int]) -> "ByteDetokenizer":
        return ByteDetokenizer()


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

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) or [self.tok.eos_token_id or 0]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def detokenizer(self, prompt_ids: list[int]) -> "HFDetokenizer":
        return HFDetokenizer(self.tok, prompt_ids)


class HFDetokenizer:
    """Incremental detokenization: decode a short window of recent tokens and
    emit only the new suffix; hold back text ending in U+FFFD (an incomplete
    multi-byte character) until the next token completes it."""

    def __init__(self, tok, prompt_ids: list[int], window: int = 6):
        self.tok = tok
        self.ids: list[int] = list(prompt_ids[-window:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

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

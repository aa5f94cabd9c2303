"""Incremental detokenization and stop strings for one request's stream of token ids.

A token may end in the middle of a UTF-8 character (byte-level vocabularies split them), and a SentencePiece
token's leading space only shows next to its left neighbour. So each new piece is the difference between decoding
a short window of ids with and without the new ones, and a piece that ends in U+FFFD (an unfinished character) is
held until the next token completes it. Text that could still become a stop string is held back as well.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_CONTEXT = 5  # ids of left context decoded with each new piece


class Detokenizer:
    """Turns ids into text pieces: `add(id) -> str` (maybe empty), `flush() -> str` at the end.

    prompt_ids give the first pieces their left context. stop: strings that end the text (the text before the
    first occurrence is kept, the stop string itself is not); `stopped` says one was seen.
    """

    def __init__(self, tokenizer, prompt_ids=(), stop=()):
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in prompt_ids[-_CONTEXT:]]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The new text that `token_id` completes, after stop strings and hold-backs; "" once stopped."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """What is still held (stop-string candidates, an unfinished character decoded as U+FFFD)."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix_offset :])
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(tail) > len(before):
            self.text += tail[len(before) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            search_from = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self.text = self.text[: min(hits)]
                piece, self.emitted = self.text[self.emitted :], len(self.text)
                return piece
            if not final:  # a stop string may be starting at the end: hold that much back
                hold = max(len(s) for s in self.stop) - 1
                end = max(self.emitted, len(self.text) - hold)
                piece, self.emitted = self.text[self.emitted : end], end
                return piece
        piece, self.emitted = self.text[self.emitted :], len(self.text)
        return piece

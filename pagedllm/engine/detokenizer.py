"""Incremental detokenization and stop-string matching for one sample.

Decoding only a short window of ids per step keeps the cost per token constant. Text that ends in an
incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it, and outputs hold back text that
may be the start of a stop string (visible_text) until the next tokens decide.
"""
from __future__ import annotations

# Prompt tokens kept as left context: tokenizers such as SentencePiece decode a word differently at the
# start of a string than after other text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        # As in vLLM, stop strings count only from the token after min_tokens on (text before stays searchable
        # only as the overlap of the next token's text).
        self.min_tokens = min_tokens
        self.num_generated = 0
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int) -> str | None:
        """Adds a token; returns the stop string if the text now contains one (text is cut there)."""
        self.ids.append(token_id)
        self.num_generated += 1
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        searched = len(self.text)
        self.text += delta
        if self.num_generated <= self.min_tokens:
            return None
        # Each stop string only where it ends in the new text: one that lies wholly in what came before (a short
        # one within min_tokens, beside a longer one) was searched for already or does not count.
        hits = [(idx, s) for s in self.stop if (idx := self.text.find(s, max(0, searched - len(s) + 1))) != -1]
        if not hits:
            return None
        idx, s = min(hits)
        self.text = self.text[:idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """The text an output shows: all of it once the sample has finished, else without its longest end that is
        a proper prefix of a stop string (which the next tokens may complete, and the stop then cut)."""
        if finished:
            return self.text
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return self.text[:len(self.text) - held]

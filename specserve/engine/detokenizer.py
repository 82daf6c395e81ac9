"""Incremental detokenisation and stop-string detection."""

from __future__ import annotations

from specserve.core.sequence import Sequence

_INCOMPLETE_UTF8 = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> str | None:
        """Refresh `seq.output.text`; return the stop string found in the new text, if any.

        On a stop string the text is cut just before it (the string itself is not returned to users).
        """
        if self.tokenizer is None:
            return None
        old_len = len(seq.output.text)
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        # A multi-byte character split across tokens decodes as U+FFFD until its last byte arrives.
        text = text.rstrip(_INCOMPLETE_UTF8)
        seq.output.text = text
        stops = seq.params.stop
        if not stops:
            return None
        search_from = max(0, old_len - max(len(s) for s in stops) + 1)
        hits = [(i, s) for s in stops if (i := text.find(s, search_from)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        seq.output.text = text[:index]
        return stop

    @staticmethod
    def emittable_text(seq: Sequence) -> str:
        """Text safe to stream: while running, hold back a tail that could still begin a stop string."""
        text = seq.output.text
        if seq.is_finished or not seq.params.stop:
            return text
        hold = max(len(s) for s in seq.params.stop) - 1
        return text[: max(0, len(text) - hold)]

"""Turning a stream of token ids into text deltas, and finding stop strings in that text.

Pure logic: no I/O, no engine. Stop strings are matched on the detokenized text (not on
token ids), because one string can be spelled by many token sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class StopStringDetector:
    """Feeds generated tokens one at a time and says which text may be sent to the client.

    Decoding is incremental (each token decodes a short window, not the whole output), in
    the manner of vLLM's ``detokenize_incrementally``: ``ids[prefix:read]`` is the last
    committed chunk, decoded again only as context for the tokens after it, so that
    tokenizers whose decoding depends on the previous token (a leading space) stay exact.

    Invariants: the concatenation of every delta returned is a prefix of the final text;
    text that could still turn into a stop string, and an incomplete UTF-8 character, are
    held back until they are decided; once a stop string appears, the text ends right before it.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stop_strings if s)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded = ""  # text of ids[:read_offset]
        self._emitted_chars = 0
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    @property
    def text(self) -> str:
        """The completion's text so far (up to, not including, a stop string)."""
        return self._decoded

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text delta that is now safe to send."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        added = self._pending_text()
        if added and not added.endswith(REPLACEMENT_CHAR):
            self._commit(added)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: the text still held back (nothing after a stop string)."""
        if self.stopped:
            return ""
        added = self._pending_text()
        if added:
            self._commit(added)
        return self._release(final=True)

    def _pending_text(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        return window[len(context) :] if len(window) > len(context) else ""

    def _commit(self, added: str) -> None:
        self._decoded += added
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        text = self._decoded
        if self._stops:
            # Text already sent holds no stop string and ends in none of their prefixes.
            hits = [i for i in (text.find(s, self._emitted_chars) for s in self._stops) if i >= 0]
            if hits:
                end = min(hits)
                self.stopped = True
                self._decoded = text[:end]
                delta = text[self._emitted_chars : end]
                self._emitted_chars = end
                return delta
        safe_end = len(text) if final else len(text) - self._stop_prefix_suffix_chars(text)
        if safe_end <= self._emitted_chars:
            return ""
        delta = text[self._emitted_chars : safe_end]
        self._emitted_chars = safe_end
        return delta

    def _stop_prefix_suffix_chars(self, text: str) -> int:
        held = 0
        for stop in self._stops:
            # Longest proper prefix of ``stop`` that ``text`` ends with.
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

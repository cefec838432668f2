"""Token ids → streamed text that a client can show as it arrives.

A chunk never ends in half a UTF-8 character (byte-fallback tokens decode to U+FFFD until the
character is whole) nor in half a Bengali grapheme cluster: a consonant may still take a vowel
sign, nukta or virama, and a virama joins the next consonant into a conjunct (Unicode 15.1
treats consonant + virama + consonant as one cluster), so the open cluster at the end is held
back until a character that starts a new cluster arrives. Text that could be the start of a stop
string is held back too, and a stop string ends the text before it (OpenAI: it is not returned).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
VIRAMA = "\u09cd"
ZW = ("\u200c", "\u200d")  # ZWNJ, ZWJ: they shape the cluster they sit in


def _bengali_letter(ch: str) -> bool:
    """A Bengali consonant or independent vowel (a cluster base), not a digit or sign."""
    return "\u0980" <= ch <= "\u09ff" and unicodedata.category(ch) == "Lo"


def _extends(ch: str) -> bool:
    return unicodedata.category(ch) in ("Mn", "Mc", "Me") or ch in ZW


def open_cluster_start(text: str) -> int:
    """Index where the last grapheme cluster starts if it may still grow, else len(text)."""
    i = len(text)
    if i == 0:
        return 0
    last = text[-1]
    if not (_bengali_letter(last) or _extends(last)):
        return i
    # Walk back over marks and over consonant + virama (+ ZWJ/ZWNJ) links to the cluster base.
    j = i - 1
    while j > 0:
        if _extends(text[j]):
            j -= 1
        elif _bengali_letter(text[j]) and text[j - 1] in (VIRAMA, *ZW):
            j -= 1
        else:
            break
    base = text[j]
    if not (_bengali_letter(base) or _extends(base)):
        return i  # marks on a non-Bengali base: nothing Bengali can join them
    return j


def stop_prefix_start(text: str, stops: Sequence[str]) -> int:
    """Index of the longest tail of `text` that is a proper prefix of a stop string."""
    start = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                start = min(start, len(text) - n)
                break
    return start


class TextStream:
    """Feed generated ids one at a time; get back the text that is safe to send.

    `decode` is the tokenizer's decode (ids → str). `context` holds a few prompt ids that are
    decoded in front of the completion, so that decoders which treat the first token specially
    (a leading space stripped) decode the completion as they would inside the whole text.
    """

    def __init__(self, decode, stops: Sequence[str] = (), context: Sequence[int] = ()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.context = list(context)
        self.prefix = decode(self.context) if self.context else ""
        self.ids: list[int] = []
        self.sent = 0  # characters of the completion already returned
        self.stopped = False

    def text(self) -> str:
        full = self.decode(self.context + self.ids)
        return full[len(self.prefix) :] if full.startswith(self.prefix) else full

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def push(self, token_id: int) -> str:
        """Add one id; return the new safe text (maybe empty). After a stop string, `stopped`."""
        self.ids.append(token_id)
        text = self.text()
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        safe = len(text)
        if text.endswith(REPLACEMENT):
            safe = len(text.rstrip(REPLACEMENT))
        safe = min(safe, open_cluster_start(text[:safe]), stop_prefix_start(text, self.stops))
        return self._emit(text[:safe])

    def finish(self) -> str:
        """The held-back rest at the end of generation (a stop string ends it first)."""
        if self.stopped:
            return ""
        text = self.text()
        cut = self._find_stop(text)
        return self._emit(text if cut is None else text[:cut])

    def _emit(self, safe: str) -> str:
        # A held-back tail can decode differently once more ids arrive; never take text back.
        if len(safe) <= self.sent:
            return ""
        new = safe[self.sent :]
        self.sent = len(safe)
        return new

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
MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte tokens
MAX_CLUSTER = 32  # characters; a Bengali cluster has under 10


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
    """Index of the longest tail of `text` that is a proper prefix of a stop string. Only the
    last len(stop) - 1 characters can start one, so the work is bounded by the stops' length."""
    start = len(text)
    for stop in stops:
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while 0 <= i < start:
            if stop.startswith(text[i:]):
                start = i
                break
            i = text.find(stop[0], i + 1)
    return start


class TextStream:
    """Feed generated ids one at a time; get back the text that is safe to send.

    `decode` is the tokenizer's decode (ids → str). `context` holds a few prompt ids that are
    decoded in front of the completion, so that decoders which treat the first token specially
    (a leading space stripped) decode the completion as they would inside the whole text.

    The work per id does not grow with the completion. Decoding is incremental: the window
    decoded is the ids read last time, whose text (`prefix`) is cut off the front, and the ids
    since, and it moves on once its text ends in a whole character. A window starts where the
    text before it is whole characters, so decoders that join pieces (ByteFallback + Fuse,
    ByteLevel) give the text that decoding the whole completion at once gives. Only the text
    not sent yet is kept: a stop string cannot start in text already sent (its beginning would
    have been held back), so that is all the stop search reads, and only its new tail at that.
    """

    def __init__(self, decode, stops: Sequence[str] = (), context: Sequence[int] = ()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids = list(context)  # the decode window: ids[:read] are decoded into text
        self.read = len(self.ids)
        self.prefix = decode(self.ids) if self.ids else ""  # the text of ids[:read]
        self.held = ""  # decoded text not sent yet
        self.stopped = False
        self.stop: str | None = None  # the stop string that ended the text, once one has

    def _new_text(self, token_id: int) -> str:
        self.ids.append(token_id)
        window = self.decode(self.ids)
        pending = len(self.ids) - self.read
        if window.endswith(REPLACEMENT) and pending < MAX_CHAR_TOKENS:
            return ""  # half a UTF-8 character: its other bytes are in the next ids
        cut = len(self.prefix)
        if not window.startswith(self.prefix):  # the prompt ended in half a character
            cut = len(self.prefix.rstrip(REPLACEMENT))
        new = window[cut:]
        # Move the window on: the ids just read become its front (their text is cut off the
        # next window's text) and older ones are dropped.
        del self.ids[: self.read]
        self.read = len(self.ids)
        self.prefix = self.decode(self.ids)
        return new

    def push(self, token_id: int) -> str:
        """Add one id; return the new safe text (maybe empty). After a stop string, `stopped`."""
        if self.stopped:
            return ""
        new = self._new_text(token_id)
        if not new:
            return ""
        before = len(self.held)
        self.held += new
        cut = self._find_stop(before)
        if cut is not None:
            self.stopped = True
            out, self.held = self.held[:cut], ""
            return out
        safe = min(self._cluster_start(), stop_prefix_start(self.held, self.stops))
        return self._emit(safe)

    def finish(self) -> str:
        """The held-back rest at the end of generation (a stop string ends it first)."""
        if self.stopped:
            return ""
        before = len(self.held)
        if len(self.ids) > self.read:  # ids that never made a whole character
            self.held += self.decode(self.ids)[len(self.prefix) :]
        cut = self._find_stop(before)
        self.stopped = cut is not None
        return self._emit(len(self.held) if cut is None else cut)

    def _find_stop(self, before: int) -> int | None:
        """Where the first stop string in `held` starts; it can only end in the new text, so
        the search starts len(stop) - 1 characters before that."""
        hits = []
        for s in self.stops:
            i = self.held.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                hits.append((i, s))
        if not hits:
            return None
        cut, self.stop = min(hits, key=lambda hit: hit[0])
        return cut

    def _cluster_start(self) -> int:
        """Where the open cluster at the end of `held` starts; a run of marks longer than any
        real cluster is not held back (a model can emit marks without end)."""
        tail = self.held[-MAX_CLUSTER:]
        i = open_cluster_start(tail)
        if i == 0 and len(self.held) > len(tail):
            return len(self.held)
        return len(self.held) - len(tail) + i

    def _emit(self, safe: int) -> str:
        out, self.held = self.held[:safe], self.held[safe:]
        return out

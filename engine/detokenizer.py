"""Incremental detokenization with stop strings, one Detokenizer per sequence.

Decoding follows vLLM's prefix_offset / read_offset scheme: each step decodes only a short
window of recent tokens, twice (with and without the new ones), and takes the difference.
The window starts one step back, so decoders that treat a window's first token specially
(SentencePiece drops its leading space) only do so to text that is already out. Where the Rust
tokenizer decodes plainly (``rust_tokenizer``), its ``DecodeStream`` runs that scheme in one
call a token, as vLLM's fast detokenizer does: 1.2 us a token of SmolLM2's against 4.7 for the
two decodes and their Python (Intel Xeon, 2.6 GHz); the windows then decode only a tail that
ends mid-character, which the stream holds back.
"""

from typing import TYPE_CHECKING, cast
from weakref import WeakKeyDictionary

from tokenizers.decoders import DecodeStream
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what a token ending inside a UTF-8 sequence decodes to


def decode(tokenizer: "PreTrainedTokenizerBase", ids: list[int],
           skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode`` of one list of ids: one str (its declared type covers batches)."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def rust_tokenizer(tokenizer: "PreTrainedTokenizerBase") -> "Tokenizer | None":
    """The Rust tokenizer behind a tokenizers-backed ``tokenizer`` whose decode adds nothing
    to it (no clean-up of spaces, ``_decode`` not overridden), else None. Decoding with it
    directly took 1.9 us instead of 5.2 for a 7-token window of SmolLM2's; a sequence decodes
    two windows a token, and at batch 256 on an H200 the host's per-token work, not the GPU,
    set the step time."""
    try:
        return _RUST[tokenizer]
    except KeyError:
        plain = (type(tokenizer)._decode is TokenizersBackend._decode
                 and not tokenizer.clean_up_tokenization_spaces)
        backend = cast(TokenizersBackend, tokenizer).backend_tokenizer if plain else None
        _RUST[tokenizer] = backend
        return backend


_RUST: "WeakKeyDictionary[PreTrainedTokenizerBase, Tokenizer | None]" = WeakKeyDictionary()


class Detokenizer:
    """Turns output tokens into text, finds stop strings, and hands out stream deltas.

    The text lives in three parts, so that each step touches only recent characters:
    `_out` (handed out by pop_delta), `_ready` (settled, not handed out yet) and `_recent`:
    the last `_holdback` settled characters, which a stop string found later may still cut,
    followed by `_pending` unsettled ones, which end in an incomplete character that the
    next token may complete. `stop_str` is the stop string that matched, if any.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", params: SamplingParams,
                 final_only: bool = False) -> None:
        """``final_only``: the caller reads the text only once the sample finishes (as
        ``LLM.generate``), so where no stop string needs searching as the text grows, ``add``
        keeps the ids and the text is decoded once, when read (the last delta holds it
        whole)."""
        self.tokenizer = tokenizer
        self._rust = rust_tokenizer(tokenizer)
        self.params = params
        self.token_ids: list[int] = []
        self.stop_str: str | None = None
        self._deferred = final_only and not params.stop
        self._stream = (DecodeStream(skip_special_tokens=params.skip_special_tokens)
                        if self._rust is not None and not self._deferred else None)
        self._prefix_offset = 0  # window start: context that is decoded but already in text
        self._read_offset = 0  # tokens before this are in text for good
        self._out: list[str] = []
        self._ready: list[str] = []
        self._recent = ""
        self._pending = 0
        # A stop string may end in text not seen yet, so this many trailing characters of the
        # settled text are not handed out while the sequence runs.
        self._holdback = max(map(len, params.stop), default=1) - 1

    @property
    def text(self) -> str:
        """The output text: `tokenizer.decode(output ids)`, cut at a stop string. O(length)."""
        if self._deferred:
            return self._decode(self.token_ids)
        self._out = ["".join(self._out)]
        return self._out[0] + "".join(self._ready) + self._recent + self._held_tail()

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return decode(self.tokenizer, ids, self.params.skip_special_tokens)

    def add(self, token_ids: list[int]) -> bool:
        """Append output tokens. True if a stop string now occurs: text is cut there and the
        sequence is done, so add is not called again."""
        if self._deferred:
            self.token_ids.extend(token_ids)
            return False
        text, pending = self._advance(token_ids)
        # _recent keeps just the settled text a stop string may start in (the text before it
        # was searched on earlier calls), then the new text, of which `pending` chars unsettled.
        self._recent = self._recent[: len(self._recent) - self._pending] + text
        self._pending = pending
        matches = [(i, s) for s in self.params.stop if (i := self._recent.find(s)) != -1]
        if matches:  # the earliest one wins
            i, self.stop_str = min(matches, key=lambda m: m[0])
            end = i + len(self.stop_str) if self.params.include_stop_str_in_output else i
            self._recent, self._pending = self._recent[:end], 0
            return True
        cut = len(self._recent) - self._pending - self._holdback
        if cut > 0:
            self._ready.append(self._recent[:cut])
            self._recent = self._recent[cut:]
        return False

    def _advance(self, token_ids: list[int]) -> tuple[str, int]:
        """Takes the new tokens; returns the text since the last settled token and how many of
        its characters are unsettled: a tail that ends mid-character (U+FFFD), which the next
        token may complete. The stream, where there is one, decides what is settled, and the
        tail is decoded only where stop strings are to be searched; else it waits for
        ``_held_tail``. Random token ids, as in the benchmarks' random models, end mid-character
        on most tokens: decoding their tails each step undid the stream's gain."""
        settled: list[str] = []
        rest = token_ids
        if self._stream is not None and self._rust is not None:
            for n, token in enumerate(token_ids):
                self.token_ids.append(token)
                try:
                    chunk = self._stream.step(self._rust, token)
                except Exception:  # noqa: BLE001 ("invalid prefix"): windows from here on
                    self._stream, rest = None, token_ids[n + 1:]
                    break
                if chunk is not None:
                    settled.append(chunk)
                    self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            else:
                rest = []
        self.token_ids.extend(rest)
        if self._read_offset == len(self.token_ids) or self._tail_held():
            return "".join(settled), 0
        unsettled = self._tail()
        if self._stream is None and not unsettled.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return "".join(settled) + unsettled, 0
        # Mid-character: keep the window so the next decode sees the whole character.
        return "".join(settled) + unsettled, len(unsettled)

    def _tail(self) -> str:
        """The text of the tokens after the read offset, decoded in a window from the prefix
        offset."""
        window = self.token_ids[self._prefix_offset:]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        return self._decode(window)[len(prefix_text):]

    def _tail_held(self) -> bool:
        """Whether ``add`` leaves the stream's unsettled tail undecoded: no stop strings."""
        return self._stream is not None and not self.params.stop

    def _held_tail(self) -> str:
        """The unsettled tail that the stream holds and ``add`` did not decode; else ''."""
        held = self._tail_held() and self._read_offset < len(self.token_ids)
        return self._tail() if held else ""

    def resume(self, token_ids: list[int], emitted_chars: int) -> None:
        """Continue a sequence begun elsewhere: its output tokens so far, of whose text the
        first ``emitted_chars`` characters were already handed out."""
        for token_id in token_ids:  # one by one, as they came: the same state, settled alike
            self.add([token_id])
        ready = "".join(self._ready)  # everything handed out was settled text
        self._out, self._ready = [ready[:emitted_chars]], [ready[emitted_chars:]]

    def pop_delta(self, finished: bool) -> str:
        """Text not handed out yet. While running, hold back the unsettled tail and the last
        `longest stop - 1` settled characters, so nothing handed out is ever cut later."""
        if self._deferred:
            return self.text if finished else ""
        if finished:
            self._ready.append(self._recent + self._held_tail())
            self._recent = ""
            self._read_offset = len(self.token_ids)  # the held tail is out too
        delta = "".join(self._ready)
        self._out.append(delta)
        self._ready = []
        return delta


def held_back_text(tokenizer: "PreTrainedTokenizerBase", params: SamplingParams,
                   token_ids: list[int], emitted_chars: int) -> str:
    """The text of a sample's ``token_ids`` beyond its first ``emitted_chars`` characters
    that its detokenizer would hand out on finishing: what it held back (an incomplete
    character, a possible stop string). For a service that ends a sample whose detokenizer it
    does not hold (worker/driver.py, on a cancel). Rebuilt token by token as a resumed
    sample's is: exact, O(tokens), ~10 us a token."""
    detokenizer = Detokenizer(tokenizer, params)
    detokenizer.resume(token_ids, emitted_chars)
    return detokenizer.pop_delta(finished=True)

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。我们一起去公园吧。",
    "Emoji time 😀🎉👍🏽 and 🇯🇵 flags, café naïve.",
    "Mixed: hello 世界 😀 done.",
]
TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji 😀🎉👍🏽🇯🇵 and 🦀 (never seen in training) end",
    "Mixed: hello 世界 😀 done, café naïve 我们一起去公园吧 the lazy dog 👍🏽.",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: with 320 entries most CJK and emoji characters span tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(autouse=True, params=["stream", "window"])
def path(request, monkeypatch) -> str:
    """Every test on both paths: the Rust tokenizer's DecodeStream, and the decoded windows a
    tokenizer without a plain Rust decode takes (its transformers ``decode``)."""
    if request.param == "window":
        monkeypatch.setattr("engine.detokenizer.rust_tokenizer", lambda tokenizer: None)
    return request.param


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids: list[int], params: SamplingParams, chunks: list[int] | None = None):
    """Feed ids in chunks; return (detokenizer, deltas, index of the chunk that stopped)."""
    detok = Detokenizer(tok, params)
    deltas, pos, stopped_at = [], 0, None
    for n, size in enumerate(chunks or [1] * len(ids)):
        stopped = detok.add(ids[pos:pos + size])
        pos += size
        deltas.append(detok.pop_delta(finished=stopped or pos >= len(ids)))
        if stopped:
            stopped_at = n
            break
    return detok, deltas, stopped_at


def test_fixture_splits_characters(tok):
    # Otherwise the tests below would not exercise partial characters.
    assert any("\ufffd" in tok.decode([i]) for t in TEXTS for i in encode(tok, t))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok, text):
    ids = encode(tok, text)
    detok, deltas, _ = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # no partial character is ever handed out


@pytest.mark.parametrize("stop", [["never matches"], []])  # with no stop, tails wait undecoded
def test_text_tracks_decode_while_running(tok, stop):
    ids = encode(tok, TEXTS[1] + TEXTS[2])
    detok = Detokenizer(tok, SamplingParams(stop=stop))
    for n in range(len(ids)):
        assert not detok.add(ids[n:n + 1])
        assert detok.text == tok.decode(ids[: n + 1])
        detok.pop_delta(finished=False)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_and_random_tokens(tok, seed):
    rng = random.Random(seed)
    # Random ids include lone continuation bytes, which decode to U+FFFD for good.
    ids = [rng.randrange(len(tok)) for _ in range(60)] + encode(tok, rng.choice(TEXTS))
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
    for skip in (True, False):
        detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip), chunks)
        assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_unfinished_partial_character_is_flushed_at_the_end(tok):
    ids = encode(tok, "好😀")
    ids = ids[:-1]  # stop the emoji's bytes half way, e.g. at max_tokens
    detok, deltas, _ = stream(tok, ids, SamplingParams())
    assert tok.decode(ids).endswith("\ufffd")
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert "\ufffd" not in "".join(deltas[:-1])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    ids = [special[0]] + encode(tok, "你好 hello") + [special[1]] + encode(tok, "世界")
    detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|endoftext|>" in detok.text) != skip


def test_window_stays_small(tok, monkeypatch, path):
    """Each step decodes a few recent tokens, never the whole output (the stream decodes
    windows only for a tail that ends mid-character)."""
    ids = encode(tok, " ".join(TEXTS * 4))
    lengths = []
    original = Detokenizer._decode

    def spy(self, token_ids):
        lengths.append(len(token_ids))
        return original(self, token_ids)

    monkeypatch.setattr(Detokenizer, "_decode", spy)
    detok, _, _ = stream(tok, ids, SamplingParams())
    assert detok.text == tok.decode(ids)
    assert len(ids) > 100 and max(lengths, default=0) <= 6
    # with no stop string to search, the stream leaves its held tail undecoded until the end
    assert len(lengths) == (0 if path == "stream" else 2 * len(ids))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["天气很", "😀🎉", "o w", "lazy dog"])
def test_stop_string_spanning_tokens(tok, stop, include):
    text = "Hello world, 你好，今天天气很好。 Emoji 😀🎉 the lazy dog and more text after it"
    ids = encode(tok, text)
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop spans token boundaries
    params = SamplingParams(stop=["never matches", stop], include_stop_str_in_output=include)
    detok, deltas, stopped_at = stream(tok, ids, params)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.text == "".join(deltas) == text[:cut]
    assert detok.stop_str == stop
    # It stops at the very token that completes the stop string.
    assert stop in tok.decode(ids[:stopped_at + 1]) and stop not in tok.decode(ids[:stopped_at])
    # Nothing handed out is retracted: every partial concatenation is a prefix of the result.
    for n in range(len(deltas)):
        assert text[:cut].startswith("".join(deltas[: n + 1]))


def test_holdback_then_release(tok):
    text = "the lazy dog jumps"
    ids = encode(tok, text)
    detok, deltas, stopped_at = stream(tok, ids, SamplingParams(stop=["lazy cat"]))
    assert stopped_at is None and "".join(deltas) == text
    # While running, at least len("lazy cat") - 1 characters stay held back.
    assert len("".join(deltas[:-1])) <= len(text) - (len("lazy cat") - 1)


def test_earliest_stop_wins(tok):
    text = "Hello world, the quick brown fox"
    ids = encode(tok, text)
    params = SamplingParams(stop=["quick", "world", "the"])
    for chunks in (None, [len(ids)]):  # all three complete within one add in the second run
        detok, _, _ = stream(tok, ids, params, chunks)
        assert detok.text == "Hello " and detok.stop_str == "world"


def test_stop_in_a_multi_token_chunk(tok):
    text = "你好，世界！今天天气很好。"
    ids = encode(tok, text)
    detok, deltas, stopped_at = stream(tok, ids, SamplingParams(stop=["世界"]), [len(ids)])
    assert stopped_at == 0 and detok.text == "".join(deltas) == "你好，"


def test_stream_error_falls_back_to_windows(tok, monkeypatch):
    """DecodeStream raises on tokenizers whose window text does not start with the prefix's
    ("invalid prefix", seen by vLLM); the detokenizer then decodes windows, text unchanged.
    No tokenizer here raises, so a stream that fails at the 7th token stands in for one."""
    real = DecodeStream

    class FailingStream:
        def __init__(self, **kwargs):
            self.stream, self.count = real(**kwargs), 0

        def step(self, tokenizer, token):
            self.count += 1
            if self.count == 7:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(tokenizer, token)

    ids = encode(tok, TEXTS[2])
    monkeypatch.setattr("engine.detokenizer.DecodeStream", FailingStream)
    detok, deltas, _ = stream(tok, ids, SamplingParams(), [3, 5] + [1] * (len(ids) - 8))
    assert detok._stream is None and "".join(deltas) == detok.text == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_final_only_decodes_once_with_the_streamed_text(tok, skip):
    """``final_only`` (LLM.generate): no text until the sample finishes, then the text the
    token-by-token path gives, whole; with stop strings it streams as before (they are
    searched as the text grows)."""
    special = tok.convert_tokens_to_ids(["<|im_start|>"])
    ids = special + encode(tok, TEXTS[2]) + encode(tok, "好😀")[:-1]  # ends mid-character
    params = SamplingParams(skip_special_tokens=skip)
    streamed, _, _ = stream(tok, ids, params)
    final = Detokenizer(tok, params, final_only=True)
    deltas = []
    for n, token in enumerate(ids):
        assert not final.add([token])
        deltas.append(final.pop_delta(finished=n == len(ids) - 1))
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == final.text == streamed.text == tok.decode(ids, skip_special_tokens=skip)
    stopping = SamplingParams(stop=["世界"])
    detok, deltas, stopped_at = stream(tok, encode(tok, TEXTS[0]), stopping)
    final = Detokenizer(tok, stopping, final_only=True)
    assert any(final.add([t]) for t in encode(tok, TEXTS[0]))  # still stops on the string
    assert final.text == detok.text == "你好，"

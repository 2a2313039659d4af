"""Tokenizer loading, special ids, incremental detokenisation and stop strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from freetokend.engine.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

# --- loading -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(builtin_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir)


def test_builtin_ids(tok: Tokenizer) -> None:
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert im_end is not None and eot is not None
    assert tok.eos_token_ids == frozenset({im_end, eot})
    assert tok.pad_token_id == eot
    assert tok.bos_token_id is None  # tokenizer_config says bos_token: null
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    assert set(tok.added_tokens) >= {"<|im_start|>", "<think>", "</tool_response>"}
    specials = {tok.id_to_token(i) for i in tok.special_token_ids}
    assert specials == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}  # think/tool: not special
    assert tok.token_to_id("no such token") is None
    assert tok.id_to_token(10**6) is None


def test_encode_matches_added_tokens_and_decode_can_skip_specials(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<think>x</think><|im_end|>")
    assert ids[0] == tok.added_tokens["<|im_start|>"]
    assert tok.added_tokens["<think>"] in ids and ids[-1] == tok.added_tokens["<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>user\nhi<think>x</think><|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"


def test_a_long_text_is_encoded_with_the_gil_released(tok: Tokenizer) -> None:
    """``tokenizers.Tokenizer.encode`` holds the GIL throughout: a server worker tokenizing a
    prompt of megabytes stopped the event loop for seconds. Long texts go through the
    GIL-releasing batch call, with the same ids (added tokens included)."""
    import threading
    import time

    text = ('<|im_start|>user\nalpha beta {"k": 12345}\n<|im_end|> ' * 6_000)[:300_000]
    assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    short = text[:1000]
    assert tok.encode(short) == tok.backend.encode(short, add_special_tokens=False).ids
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    ticks, started = 0, time.monotonic()
    worker.start()
    while not done.is_set():
        time.sleep(0.002)
        ticks += 1
    took = time.monotonic() - started
    worker.join()
    # held GIL: this thread wakes once or twice in the whole call
    assert took < 0.05 or ticks >= 10, (took, ticks)


def _copy_tokenizer(src: Path, dst: Path, **files: dict) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    for name, content in files.items():
        (dst / f"{name}.json").write_text(json.dumps(content))
    return dst


def test_eos_is_the_union_of_every_source(builtin_model_dir: Path, tmp_path: Path) -> None:
    think = Tokenizer.from_dir(builtin_model_dir).added_tokens["<think>"]
    d = _copy_tokenizer(
        builtin_model_dir,
        tmp_path / "m",
        generation_config={"eos_token_id": [3, 4]},
        config={"eos_token_id": 5, "bos_token_id": 6, "pad_token_id": 7},
        tokenizer_config={"eos_token": {"content": "<think>", "special": False}},
    )
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == frozenset({3, 4, 5, think})
    assert t.bos_token_id == 6  # the tokenizer files do not name a bos: config's id applies
    assert t.pad_token_id == 7


def test_special_tokens_map_and_nested_text_config(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer(
        builtin_model_dir,
        tmp_path / "m",
        special_tokens_map={"bos_token": "<|im_start|>", "pad_token": "<|im_end|>"},
        config={"text_config": {"eos_token_id": 9}},
    )
    t = Tokenizer.from_dir(d)
    assert t.bos_token_id == t.added_tokens["<|im_start|>"]
    assert t.pad_token_id == t.added_tokens["<|im_end|>"]
    assert t.eos_token_ids == frozenset({9})


def test_added_tokens_listed_only_in_tokenizer_config(
    builtin_model_dir: Path, tmp_path: Path
) -> None:
    decoder = {"999": {"content": "<|extra|>", "special": True}}
    d = _copy_tokenizer(
        builtin_model_dir, tmp_path / "m", tokenizer_config={"added_tokens_decoder": decoder}
    )
    t = Tokenizer.from_dir(d)
    extra = t.token_to_id("<|extra|>")
    assert extra is not None and extra in t.special_token_ids and t.encode("<|extra|>") == [extra]


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)


# --- incremental detokenisation ------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


@settings(max_examples=150, deadline=None)
@example(text="\ufffd")  # found by hypothesis: the old oracle refused any U+FFFD
@example(text="a\ufffd\ufffdb\ufffd")
@given(text=st.text(max_size=60))
def test_stream_equals_full_decode_and_never_splits_a_char(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    # Pieces are never taken back, so the equality above already says that no half character
    # was released as U+FFFD on the way (a U+FFFD the text holds is released, of course). And
    # every character is released by the push of its last token, none is left for the flush,
    # except U+FFFDs that end the text: they look like a half character, so they wait.
    assert pieces[-1] == "" or (set(pieces[-1]) == {"\ufffd"} and text.endswith("\ufffd"))


def test_multibyte_chars_wait_for_their_last_byte(tok: Tokenizer) -> None:
    ids = tok.encode("日🎉")  # 3 + 4 byte tokens, no merges cover them
    assert len(ids) == 7
    pieces = stream(tok, ids)
    assert pieces == ["", "", "日", "", "", "", "🎉", ""]


def test_special_tokens_in_stream(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_end|>b")
    assert "".join(stream(tok, ids)) == "a<|im_end|>b"
    assert "".join(stream(tok, ids, skip=True)) == "ab"


def test_invalid_bytes_are_released_not_held_forever(tok: Tokenizer) -> None:
    cont = next(i for i in range(256) if tok.decode([i]) == "\ufffd")  # a lone UTF-8 tail byte
    detok = IncrementalDetokenizer(tok, max_pending=8)
    out = [detok.push(cont) for _ in range(20)]
    assert "".join(out) != ""  # released after max_pending tokens, before flush
    assert "".join(out) + detok.flush() == tok.decode([cont] * 20)


def test_window_stays_small(tok: Tokenizer) -> None:
    text = "The quick brown fox, 日本語 and emojis 🎉🎉, jumps over the lazy dog. " * 20
    ids = tok.encode(text)
    seen: list[int] = []
    original = tok.decode

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):  # type: ignore[no-untyped-def]
            seen.append(len(list(ids)))
            return original(ids, skip_special_tokens)

    spy = Spy(tok.backend)
    assert "".join(stream(spy, ids)) == text
    assert len(ids) > 500 and max(seen) <= 16


def _byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer: Metaspace, <0xXX> byte fallback, leading-space strip."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "▁hello", "▁world", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll"]:
        vocab.setdefault(piece, len(vocab))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return Tokenizer(backend)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("helowrd 日é🎉")), max_size=30))
def test_byte_fallback_stream(text: str) -> None:
    tok = _byte_fallback_tokenizer()
    ids = tok.encode(text)
    assert any(1 <= i <= 256 for i in ids) or not set(text) & set("日é🎉")
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


# --- stop strings --------------------------------------------------------------------------


def run_stop(stops: list[str], deltas: list[str]) -> tuple[str, bool, str | None]:
    checker = StopChecker(stops)
    out, stopped, matched = "", False, None
    for delta in deltas:
        text, stopped, matched = checker.feed(delta)
        out += text
    if not stopped:
        out += checker.flush()
    return out, stopped, matched


def test_stop_split_across_deltas_is_not_emitted() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("abc S") == ("abc ", False, None)  # "S" held back
    assert checker.feed("TO") == ("", False, None)
    assert checker.feed("P tail") == ("", True, "STOP")
    assert checker.feed("more") == ("", True, "STOP")


def test_false_alarm_releases_held_text() -> None:
    assert run_stop(["STOP"], ["abc ST", "x", "yz"]) == ("abc STxyz", False, None)
    assert run_stop(["STOP"], ["abc ST"]) == ("abc ST", False, None)  # flush at the end


def test_earliest_stop_wins() -> None:
    assert run_stop(["World", "lo"], ["Hello World"]) == ("Hel", True, "lo")
    assert run_stop([], ["anything"]) == ("anything", False, None)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_checker_equals_truncating_the_text_at_the_first_completed_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    """Generation ends at the first delta after which the text holds a stop sequence; the output
    is cut where the earliest stop in that text starts. (A longer stop that would have started
    earlier but completes later never gets generated: text='baa', deltas 'ba', 'a', stops 'a' and
    'baa' give 'b'.)"""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, stopped, matched = run_stop(stops, deltas)
    seen = next((text[:b] for b in bounds if any(s in text[:b] for s in stops)), None)
    if seen is not None:
        pos = min(seen.find(s) for s in stops if s in seen)
        assert stopped and out == text[:pos]
        assert matched is not None and seen.find(matched) == pos
    else:
        assert not stopped and out == text


def test_a_stop_completed_first_wins_over_a_longer_one_starting_earlier() -> None:
    assert run_stop(["a", "baa"], ["ba", "a"]) == ("b", True, "a")

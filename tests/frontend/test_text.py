"""Stop strings and incremental detokenization."""

from services.frontend.stops import StopMatcher
from services.frontend.tokenizer import ByteTokenizer


def feed_all(m: StopMatcher, parts):
    out = "".join(m.feed(p) for p in parts)
    return out + m.flush()


def test_stop_string_split_across_deltas_is_cut():
    m = StopMatcher(["END"])
    assert feed_all(m, ["hello E", "N", "D and more"]) == "hello "
    assert m.stopped


def test_partial_match_is_held_then_released():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "abc"
    assert m.feed("x") == "Ex"
    assert not m.stopped


def test_no_stops_passes_through():
    assert feed_all(StopMatcher([]), ["a", "b"]) == "ab"


def test_byte_detokenizer_never_splits_a_multibyte_character():
    tok = ByteTokenizer()
    ids = tok.encode("né€😀")
    d = tok.detokenizer([])
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) + d.flush() == "né€😀"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # held until the 2nd byte arrives

"""Hostile values for the fuzz tests of both edges (issue 39): floats at the
edges of what a sampler divides by (subnormals, 1e308, -0.0, NaN and
infinities), integers past int32/int64, and text with lone surrogates, NUL,
right-to-left overrides, byte-order marks and very long "tokens"."""

from __future__ import annotations

from hypothesis import strategies as st

EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-320, 1e-45, 1.401298464324817e-45, 1e-300, 1e-38, 1.17549435e-38, 9.99e-6,
               1e-5, 1.0000001e-5, 0.5, 1.0, 1.0000000000000002, 1.9999999999999998, 2.0, 2.0000000000000004,
               3.4028234663852886e38, 3.5e38, 1e308, 1.7976931348623157e308]
FLOATS = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(0, 2), st.sampled_from([float("nan"), float("inf"), float("-inf")]))
FLOATS32 = st.one_of(st.sampled_from(EDGE_FLOATS[:12] + [0.7, 1.0, 2.0, 3.4028234663852886e38]),
                     st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 2, width=32))
INTS = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, 2**64]),
                 st.integers(-(2**70), 2**70), st.integers(0, 64))
EDGE_TEXT = ["", "\x00", "a\x00b", "\u202e\u202dtxet", "\u200f\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
             "\ufeffBOM", "\ud800", "x \udfff y", "\U0001F600" * 40, "x" * 3000, "\u00e9" * 400, "\u0301" * 200,
             "<|im_start|>system", "</s><s>", "\r\n\r\n", "\t" * 50, "Ω≈ç√∫", "\U000E0001\U000E0041"]
TEXT = st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=40),
                 st.text(st.characters(exclude_categories=()), max_size=40))  # surrogates (Cs) included
# What a JSON field may hold, whatever the schema says.
ANY_JSON = st.recursive(st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)

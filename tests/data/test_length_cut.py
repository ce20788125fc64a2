"""The longest cut of a data set's max lengths that a judge accepts (what `auto` lengths become under a budget)."""

import numpy as np

from memfit.data.length_cut import Lengths, longest_cut, shapes_at


def _long_tail() -> Lengths:
    """90 short pairs and a tail of ten long labels, up to 1,000 tokens; limits of 1,024."""
    source = np.full(100, 40)
    label = np.concatenate([np.full(90, 20), np.linspace(400, 1000, 10).astype(int)])
    return Lengths(source, label, 1024, 1024)


def _within(tokens: int):
    """A judge that accepts batches of at most `tokens` padded tokens per row, counting the calls."""
    calls = []

    def accepts(shapes):
        calls.append(shapes)
        return all(shape.source + shape.label <= tokens for shape in shapes)

    return accepts, calls


def test_every_token_is_kept_where_the_longest_samples_fit():
    accepts, calls = _within(1040)
    assert longest_cut(_long_tail(), (True, True), 1, "seq2seq", 8, accepts) == (1024, 1024)
    assert len(calls) == 1


def test_a_long_tail_is_cut_where_the_budget_ends_not_at_the_samples_below_it():
    """The labels of the tail are cut to the longest that fits (within one padding multiple), not to the short
    samples' 20 tokens; the sources, which fit, keep every token; about 14 judgements."""
    lengths = _long_tail()
    accepts, calls = _within(700)
    source, label = longest_cut(lengths, (True, True), 1, "seq2seq", 8, accepts)
    assert source == 1024 or source >= 40  # every source token kept
    assert 700 - 8 - 40 <= label <= 700 - 40 and label % 8 == 0
    assert all(s.source + s.label <= 700 for s in shapes_at(lengths, (source, label), 1, "seq2seq", 8))
    assert len(calls) <= 16


def test_a_length_the_user_set_is_never_cut():
    """With only the source auto, a label that does not fit stays as it is: nothing the judge accepts."""
    accepts, _ = _within(700)
    assert longest_cut(_long_tail(), (True, False), 1, "seq2seq", 8, accepts) is None


def test_none_where_not_even_the_shortest_cut_fits():
    accepts, _ = _within(30)
    assert longest_cut(_long_tail(), (True, True), 4, "seq2seq", 8, accepts) is None


def test_a_causal_lm_is_judged_on_prompt_and_response_together():
    """Causal batches are one sequence: the judge sees prompt + response, and both are cut at one share."""
    lengths = Lengths(np.array([100, 120, 3000]), np.array([50, 60, 2000]), 16384, 16384)
    accepts, _ = _within(2 * 2048)  # a causal shape counts its sequence as both source and label
    prompt, response = longest_cut(lengths, (True, True), 2, "causal", 8, accepts)
    worst = shapes_at(lengths, (prompt, response), 2, "causal", 8)[0]
    assert worst.source <= 2048 and worst.source > 2048 - 64
    assert prompt < 3000 and response < 2000

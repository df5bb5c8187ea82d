"""The copy drafter on hand-built token arrays with exact expected drafts."""
from __future__ import annotations

import time


from alphallama.spec.ngram import NgramDrafter


def draft(seq, max_n=8, n=2, **kw):
    d = NgramDrafter(ngram_min=n, **kw)
    d.begin(seq)
    return d.propose(max_n)


def test_simple_copy():
    d = draft([10, 11, 12, 13, 14, 99, 11, 12], max_n=3)
    assert d.tokens == [13, 14, 99] and d.match_len == 2 and d.source == "ngram"


def test_no_match():
    assert draft([1, 2, 3, 4, 5, 6]).tokens == []
    assert draft([]).tokens == []
    assert draft([7]).tokens == []


def test_suffix_only_matches_itself_is_not_a_match():
    # (5, 6) occurs only at the very end
    assert draft([1, 2, 3, 5, 6]).tokens == []


def test_longest_match_wins_over_most_recent():
    # suffix [1, 2, 3]: an old match of length 3 (then 40) and a recent one of length 2 (then 50)
    seq = [9, 1, 2, 3, 40, 41, 7, 2, 3, 50, 51, 8, 1, 2, 3]
    d = draft(seq, max_n=2)
    assert d.tokens == [40, 41] and d.match_len == 3   # 9 vs 8 before the match ends it


def test_most_recent_wins_on_equal_length():
    seq = [5, 2, 3, 40, 6, 2, 3, 50, 7, 2, 3]
    d = draft(seq, max_n=1)
    assert d.tokens == [50] and d.match_len == 2


def test_repeats_extend_with_the_period():
    # a repeating pattern: the continuation runs into the end and keeps copying
    assert draft([7, 1, 2, 1, 2], max_n=6).tokens == [1, 2, 1, 2, 1, 2]
    assert draft([4, 4, 4], max_n=5, n=2).tokens == [4, 4, 4, 4, 4]
    assert draft([1, 2, 3, 1, 2, 3, 1, 2], max_n=5).tokens == [3, 1, 2, 3, 1]


def test_overlapping_matches():
    # 'a a a b a a' : suffix (a, a) occurs ending at 1 and 2 (overlapping); longest extension
    a, b = 1, 2
    d = draft([a, a, a, b, a, a], max_n=3)
    # candidates end at 2 and 1; extending the one at 2 backwards meets s[0]=a vs s[3]=b,
    # so both have length 2 and the more recent (end 2, followed by b) wins
    assert d.tokens == [b, a, a] and d.match_len == 2


def test_match_at_the_very_end_of_the_previous_text():
    # the earlier occurrence is immediately before the suffix: continuation is the suffix itself
    d = draft([3, 8, 9, 8, 9], max_n=4)
    assert d.tokens == [8, 9, 8, 9]


def test_max_n_and_draft_max_cap():
    seq = list(range(20)) + [0, 1]
    assert draft(seq, max_n=5).tokens == [2, 3, 4, 5, 6]
    assert draft(seq, max_n=50, draft_max=7).tokens == [2, 3, 4, 5, 6, 7, 8]
    assert draft(seq, max_n=0).tokens == []


def test_ngram_min_threshold():
    seq = [1, 2, 3, 9, 2, 3]
    assert draft(seq, n=2, max_n=2).tokens == [9, 2]
    assert draft(seq, n=3, max_n=2).tokens == []     # only a 2-token match exists


def test_incremental_accept_equals_begin():
    seq = [5, 1, 2, 3, 6, 1, 2, 7, 1, 2, 3]
    a = NgramDrafter(2)
    a.begin(seq[:3])
    for t in seq[3:]:
        a.accept([t])
    b = NgramDrafter(2)
    b.begin(seq)
    assert a.propose(4) == b.propose(4)
    assert a.propose(4).tokens == [6, 1, 2, 7]


def test_very_long_input_cost_is_bounded():
    """Per-token cost must not grow with the context: time 2k vs 200k accepted tokens."""
    def per_token(n):
        d = NgramDrafter(2)
        d.begin([])
        seq = [(i * 7919) % 50 for i in range(n)]   # many repeats: every key has candidates
        t = time.perf_counter()
        for i in range(0, n, 100):
            d.accept(seq[i:i + 100])
            d.propose(16)
        return (time.perf_counter() - t) / n
    small, large = per_token(2_000), per_token(200_000)
    assert large < 4 * small, (small, large)


def test_very_long_input_finds_distant_match():
    seq = [1, 2, 3, 4, 5] + list(range(100, 100_100)) + [1, 2, 3]
    assert draft(seq, max_n=2).tokens == [4, 5]

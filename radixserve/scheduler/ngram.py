"""Prompt lookup for speculative decoding: where a sample's last tokens occurred before."""

from __future__ import annotations

MIN_MATCH, MAX_MATCH = 2, 8  # suffix tokens a draft must match / that a match is scored on
CANDIDATES = 16  # latest earlier occurrences of the last two tokens that are scored


class NgramIndex:
    """The end positions of every token pair of one growing token list (a sample's prompt and
    output), brought up to date on each lookup: a draft costs O(CANDIDATES * MAX_MATCH)."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, int], list[int]] = {}
        self.indexed = 1  # pairs ending before this position are indexed

    def draft(self, ids: list[int], k: int) -> tuple[int, list[list[int]]]:
        """(match length, up to `k` tokens that followed each) of the earlier occurrences of
        the end of `ids` that match it longest (up to MAX_MATCH tokens) among the latest
        CANDIDATES occurrences of its last two tokens, the latest first; (0, []) for none.
        `ids` only ever grows between calls."""
        for end in range(self.indexed, len(ids)):
            self.ends.setdefault((ids[end - 1], ids[end]), []).append(end)
        self.indexed = max(self.indexed, len(ids))
        last = len(ids) - 1
        if last < MIN_MATCH:
            return 0, []
        best_len = 0
        found: list[list[int]] = []
        ends = self.ends[(ids[last - 1], ids[last])]  # its last entry is `last` itself
        for end in reversed(ends[-CANDIDATES - 1 : -1]):
            m = MIN_MATCH
            while m < MAX_MATCH and m <= end and ids[end - m] == ids[last - m]:
                m += 1
            if m > best_len:
                best_len, found = m, []
            if m == best_len:
                found.append(ids[end + 1 : end + 1 + k])
        return (best_len, found) if k > 0 and found else (0, [])

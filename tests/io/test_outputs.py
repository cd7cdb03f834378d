"""``merge_deltas``: two consecutive DELTA outputs of one request taken as one."""

from __future__ import annotations

from jaxpaged.io.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, merge_deltas


def delta(samples, finished=False):
    return RequestOutput("r", None, [1, 2], [CompletionOutput(i, text, ids, reason, logprobs=lps)
                                            for i, text, ids, reason, lps in samples],
                         finished, 0, RequestMetrics(0.0, None, None, None))


def test_merge_concatenates_each_sample_and_keeps_the_later_state():
    lp = lambda t: {t: Logprob(-0.5, 1, None)}  # noqa: E731
    a = delta([(0, "Hel", [5], None, [lp(5)]), (1, "x", [9], None, [lp(9)])])
    b = delta([(0, "lo", [6, 7], "length", [lp(6), lp(7)])], finished=True)  # sample 1 made nothing new
    m = merge_deltas(a, b)
    assert m.finished and [c.index for c in m.outputs] == [0, 1]
    first, second = m.outputs
    assert (first.text, first.token_ids, first.finish_reason) == ("Hello", [5, 6, 7], "length")
    assert [list(d) for d in first.logprobs] == [[5], [6], [7]]
    assert (second.text, second.token_ids) == ("x", [9])
    # Merging is associative over a run of deltas: ((a, b), c) == (a, (b, c)).
    c = delta([(1, "y", [10], None, [lp(10)])])
    assert merge_deltas(merge_deltas(a, c), b).outputs[1].token_ids == merge_deltas(a, merge_deltas(c, b)).outputs[1].token_ids == [9, 10]

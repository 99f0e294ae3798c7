"""pass@k: the unbiased estimator against enumerating every subset of k samples."""

import itertools
import random

import pytest

from grpokit.cli.evaluate import pass_at_k


def test_pass_at_k_matches_enumeration():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        c, k = rng.randint(0, n), rng.randint(1, n)
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.mark.parametrize("n, c, k", [(4, 1, 0), (4, 1, 5)])
def test_pass_at_k_needs_k_within_the_samples(n, c, k):
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= n"):
        pass_at_k(n, c, k)

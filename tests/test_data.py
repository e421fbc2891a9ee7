"""spmd.data: Markov-chain token batches are reproducible, learnable and fast."""

import time

import numpy as np
import pytest

from spmd import data


def test_batch_shapes_dtype_and_range():
    tokens = data.batch(seed=0, step=0, batch_size=16, seq_len=12, vocab=50)["tokens"]
    assert tokens.shape == (16, 12)
    assert tokens.dtype == np.int32
    assert tokens.min() >= 0 and tokens.max() < 50


def test_batch_is_a_pure_function_of_its_arguments():
    a = data.batch(3, 7, 8, 16, 64)["tokens"]
    b = data.batch(3, 7, 8, 16, 64)["tokens"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, data.batch(3, 8, 8, 16, 64)["tokens"])  # another step
    assert not np.array_equal(a, data.batch(4, 7, 8, 16, 64)["tokens"])  # another seed


def test_markov_chain_is_sparse_stochastic_and_deterministic():
    p = data.markov_chain(seed=0, vocab=32, branching=4)
    assert p.shape == (32, 32)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    assert ((p > 0).sum(axis=1) == 4).all()
    np.testing.assert_array_equal(p, data.markov_chain(0, 32, 4))
    assert not np.array_equal(p, data.markov_chain(1, 32, 4))
    assert ((data.markov_chain(0, 5, branching=5) > 0).sum(axis=1) == 5).all()  # every token a successor


def test_batches_follow_the_chain():
    p = data.markov_chain(seed=2, vocab=40)
    tokens = data.batch(seed=2, step=0, batch_size=64, seq_len=16, vocab=40)["tokens"]
    assert (p[tokens[:, :-1], tokens[:, 1:]] > 0).all()


def test_empirical_entropy_matches_entropy_rate():
    vocab, seq_len = 64, 32
    tokens = np.concatenate([data.batch(0, step, 512, seq_len, vocab)["tokens"] for step in range(4)])
    current, following = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
    best = data.entropy_rate(0, vocab, seq_len=seq_len)
    # The true chain's cross-entropy on the data: an unbiased estimate of the best achievable loss.
    p = data.markov_chain(0, vocab)
    assert abs(-np.log(p[current, following]).mean() - best) < 0.03
    # Plug-in conditional entropy from counts (slightly biased low with 64k transitions over 256 pairs).
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (current, following), 1)
    conditional = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    empirical = -(counts * np.log(np.where(counts > 0, conditional, 1.0))).sum() / counts.sum()
    assert abs(empirical - best) < 0.05
    assert abs(data.entropy_rate(0, vocab) - best) < 0.05


@pytest.mark.parametrize("vocab", [16, 256, 8192])
def test_entropy_rate_is_well_below_uniform(vocab):
    h = data.entropy_rate(seed=0, vocab=vocab)
    assert 0.5 < h < 0.5 * np.log(vocab)
    assert h < np.log(4)  # at most `branching` successors per token


def test_batch_is_fast():
    data.batch(0, 0, 256, 32, 256)  # builds and caches the chain
    best = min(_time(lambda step=step: data.batch(0, step, 256, 32, 256)) for step in range(1, 6))
    assert best < 0.010


def test_gpt_small_vocab_is_cheap():
    # The chain stays sparse: vocab 8192 must not build a dense 8192 x 8192 matrix for batches.
    tokens = data.batch(0, 0, 8, 128, 8192)["tokens"]
    assert tokens.shape == (8, 128) and tokens.max() < 8192


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(seed=-1, step=0, batch_size=2, seq_len=4, vocab=8),
        dict(seed=0, step=-1, batch_size=2, seq_len=4, vocab=8),
        dict(seed=0, step=0, batch_size=0, seq_len=4, vocab=8),
        dict(seed=0, step=0, batch_size=2, seq_len=4, vocab=2),  # fewer tokens than branching=4
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        data.batch(**kwargs)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

"""Synthetic, learnable, reproducible token data: sequences sampled from a fixed random Markov chain.

Each token has ``branching`` possible successors with random (Dirichlet) probabilities, so the data has
a known entropy rate far below ``log(vocab)``: a model that learns the chain reaches a loss close to
:func:`entropy_rate`, which makes "is training working?" a question with a number for an answer.

Everything is a pure function of its arguments: a batch depends only on ``(seed, step, shapes)``, so any
process (or any host of a multi-host job) can make the same batch without communication.

>>> b = batch(seed=0, step=0, batch_size=4, seq_len=8, vocab=16)
>>> b["tokens"].shape, b["tokens"].dtype
((4, 8), dtype('int32'))
>>> bool((b["tokens"] == batch(0, 0, 4, 8, 16)["tokens"]).all())
True
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["batch", "entropy_rate", "markov_chain"]

# Mixed into the chain's seed so the chain and the batches never share a random stream.
_CHAIN_STREAM = 0x6D61726B  # "mark"
_DIRICHLET_ALPHA = 1.0  # expected per-token entropy for branching=4: 1/2 + 1/3 + 1/4 ≈ 1.08 nats


def _check(name: str, value: int, minimum: int) -> None:
    if int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@functools.lru_cache(maxsize=16)
def _sparse_chain(seed: int, vocab: int, branching: int) -> tuple[np.ndarray, np.ndarray]:
    """The chain as (successors int64[vocab, branching], cumulative probabilities float64[vocab, branching]).

    Kept sparse because a dense [vocab, vocab] matrix is 512 MB at vocab 8192; cached because every batch
    needs it. The returned arrays are read-only so the cache cannot be corrupted by a caller.
    """
    _check("seed", seed, 0)
    _check("vocab", vocab, 1)
    _check("branching", branching, 1)
    if branching > vocab:
        raise ValueError(f"branching ({branching}) must be <= vocab ({vocab})")
    rng = np.random.default_rng([seed, vocab, branching, _CHAIN_STREAM])
    # Floyd's algorithm, vectorised over rows: a uniformly random set of `branching` distinct successors per
    # token in O(vocab * branching^2), without materialising a [vocab, vocab] random matrix.
    successors = np.empty((vocab, branching), dtype=np.int64)
    for col, j in enumerate(range(vocab - branching, vocab)):
        t = rng.integers(0, j + 1, size=vocab)
        taken = (successors[:, :col] == t[:, None]).any(axis=1)
        successors[:, col] = np.where(taken, j, t)
    probs = rng.dirichlet(np.full(branching, _DIRICHLET_ALPHA), size=vocab)
    cumulative = np.cumsum(probs, axis=1)
    # Exactly 1 at the end so a uniform draw in [0, 1) always lands on a successor despite rounding.
    cumulative[:, -1] = 1.0
    successors.flags.writeable = False
    cumulative.flags.writeable = False
    return successors, cumulative


def _probabilities(cumulative: np.ndarray) -> np.ndarray:
    return np.diff(cumulative, axis=1, prepend=0.0)


def markov_chain(seed: int, vocab: int, branching: int = 4) -> np.ndarray:
    """The dense transition matrix ``P[i, j] = Pr(next = j | current = i)`` of the chain ``(seed, vocab)``.

    Each row has exactly ``branching`` non-zero entries (distinct random successors) with Dirichlet(1)
    probabilities; rows sum to 1. Deterministic in ``(seed, vocab, branching)``. Note the dense matrix is
    ``vocab**2`` float64s (512 MB at vocab 8192); :func:`batch` and :func:`entropy_rate` do not need it.

    >>> p = markov_chain(seed=0, vocab=8)
    >>> p.shape, bool(np.allclose(p.sum(axis=1), 1.0)), int((p[0] > 0).sum())
    ((8, 8), True, 4)
    >>> bool((p == markov_chain(0, 8)).all())
    True
    """
    successors, cumulative = _sparse_chain(seed, vocab, branching)
    dense = np.zeros((vocab, vocab), dtype=np.float64)
    np.put_along_axis(dense, successors, _probabilities(cumulative), axis=1)
    return dense


def batch(
    seed: int, step: int, batch_size: int, seq_len: int, vocab: int, *, branching: int = 4
) -> dict[str, np.ndarray]:
    """A batch ``{"tokens": int32[batch_size, seq_len]}`` of sequences sampled from :func:`markov_chain`.

    First tokens are uniform over the vocabulary; each next token is drawn from the chain. A pure function
    of its arguments: the same call always gives the same array, and a different ``step`` gives different
    data (the random stream is seeded by ``[seed, step]``).

    >>> t = batch(seed=1, step=3, batch_size=2, seq_len=6, vocab=32)["tokens"]
    >>> t.shape, t.dtype, bool(((t >= 0) & (t < 32)).all())
    ((2, 6), dtype('int32'), True)
    >>> bool((t == batch(1, 4, 2, 6, 32)["tokens"]).all())  # another step, other data
    False
    """
    _check("step", step, 0)
    _check("batch_size", batch_size, 1)
    _check("seq_len", seq_len, 1)
    successors, cumulative = _sparse_chain(seed, vocab, branching)
    rng = np.random.default_rng([seed, step])
    tokens = np.empty((batch_size, seq_len), dtype=np.int32)
    current = rng.integers(0, vocab, size=batch_size)
    tokens[:, 0] = current
    uniforms = rng.random((seq_len - 1, batch_size))
    rows = np.arange(batch_size)
    for t in range(1, seq_len):
        # Inverse-CDF sampling for all rows at once: the chosen successor is the number of cumulative
        # probabilities at or below the uniform draw (always < branching, as the last one is exactly 1).
        choice = (cumulative[current] <= uniforms[t - 1][:, None]).sum(axis=1)
        current = successors[current, choice]
        tokens[rows, t] = current
    return {"tokens": tokens}


@functools.lru_cache(maxsize=16)
def entropy_rate(seed: int, vocab: int, branching: int = 4, seq_len: int | None = None) -> float:
    """The chain's entropy rate in nats: the best achievable mean next-token cross-entropy on its data.

    With ``seq_len=None`` this is ``sum_i pi_i H(P[i])`` for the long-run token distribution ``pi`` reached
    from a uniform first token. With ``seq_len`` it is the exact optimum of the next-token loss on
    :func:`batch` sequences of that length (predicting tokens 1..seq_len-1 from their predecessors, whose
    distribution starts uniform and drifts towards ``pi``). The two differ only slightly.

    >>> h = entropy_rate(seed=0, vocab=256)
    >>> 0.5 < h < 1.5 < float(np.log(256))
    True
    >>> abs(entropy_rate(0, 256, seq_len=32) - h) < 0.1
    True
    """
    successors, cumulative = _sparse_chain(seed, vocab, branching)
    probs = _probabilities(cumulative)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = -np.sum(np.where(probs > 0, probs * np.log(probs), 0.0), axis=1)

    def step(dist: np.ndarray) -> np.ndarray:
        return np.bincount(successors.ravel(), weights=(dist[:, None] * probs).ravel(), minlength=vocab)

    dist = np.full(vocab, 1.0 / vocab)
    if seq_len is not None:
        _check("seq_len", seq_len, 2)
        total = 0.0
        for _ in range(seq_len - 1):
            total += float(dist @ per_token)
            dist = step(dist)
        return total / (seq_len - 1)
    # Lazy power iteration (half stay, half step) converges even for a periodic chain, to the long-run
    # average distribution of the plain chain from this start.
    for _ in range(100_000):
        new = 0.5 * (dist + step(dist))
        if np.abs(new - dist).sum() < 1e-12:
            dist = new
            break
        dist = new
    return float(dist @ per_token)

"""compress.prune: greedy neuron pruning with a closed-form refit of down_proj, against float64 least squares and
brute force over every neuron on fresh random, ragged problems."""

import numpy as np
import pytest

from jax_neuronmm.compress import prune


def _problem(seed, tokens=301, width=13, outputs=7):
    rng = np.random.default_rng(seed)
    # Correlated activations (some neurons nearly redundant) so that refitting matters.
    hidden = rng.standard_normal((tokens, width)) @ rng.standard_normal((width, width))
    down = rng.standard_normal((width, outputs))
    root = rng.standard_normal((outputs, outputs))
    return hidden, down, root @ root.T


def _error(hidden, down, kept, rows, metric):
    """Σ_t (y_t − ŷ_t)·M·(y_t − ŷ_t)ᵀ of the kept neurons with their rows against the whole MLP."""
    residual = hidden @ down - hidden[:, kept] @ rows
    return float(np.einsum("tn,nm,tm->", residual, metric, residual))


def _refit(hidden, down, kept):
    return np.linalg.lstsq(hidden[:, kept], hidden @ down, rcond=None)[0]


@pytest.mark.parametrize("metric_kind", ["squared", "fisher"])
def test_refit_rows_are_the_least_squares_fit_of_the_dense_output(metric_kind):
    hidden, down, metric = _problem(1)
    output_gram = metric if metric_kind == "fisher" else None
    kept, rows = prune.prune_neurons(hidden.T @ hidden, down, 8, output_gram, damping=0.0)
    assert kept.shape == (8,) and np.all(np.diff(kept) > 0) and rows.shape == (8, down.shape[1])
    np.testing.assert_allclose(rows, _refit(hidden, down, kept), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_each_removal_is_the_cheapest_by_brute_force(seed):
    # Greedy: the set kept after k removals equals removing, k times, the neuron whose removal (the rest refit)
    # adds least to the metric's error, found by trying every neuron with float64 least squares.
    hidden, down, metric = _problem(seed)
    gram, width = hidden.T @ hidden, hidden.shape[1]
    alive = list(range(width))
    for removed in range(1, width - 2):
        costs = {}
        for j in alive:
            rest = [i for i in alive if i != j]
            costs[j] = _error(hidden, down, rest, _refit(hidden, down, rest), metric)
        alive.remove(min(costs, key=costs.get))
        kept, rows = prune.prune_neurons(gram, down, width - removed, metric, damping=0.0)
        assert kept.tolist() == alive, (removed, kept, alive)
        assert _error(hidden, down, kept, rows, metric) == pytest.approx(min(costs.values()), rel=1e-7)


@pytest.mark.parametrize("per_round", [3, 5])
def test_rounds_remove_the_cheapest_neurons_of_each_round_and_refit_exactly(per_round):
    # Each round removes the per_round neurons whose removal alone (the rest refit) costs least, found by brute
    # force with float64 least squares; the last round removes what remains to remove (13 - 4 = 9 is no multiple
    # of either), and the kept rows are the least-squares fit of the dense output.
    hidden, down, metric = _problem(8)
    gram, width = hidden.T @ hidden, hidden.shape[1]
    alive = list(range(width))
    while len(alive) > 4:
        costs = {}
        for j in alive:
            rest = [i for i in alive if i != j]
            costs[j] = _error(hidden, down, rest, _refit(hidden, down, rest), metric)
        for j in sorted(costs, key=costs.get)[: min(per_round, len(alive) - 4)]:
            alive.remove(j)
    kept, rows = prune.prune_neurons(gram, down, 4, metric, damping=0.0, per_round=per_round)
    assert kept.tolist() == alive
    np.testing.assert_allclose(rows, _refit(hidden, down, kept), rtol=1e-8, atol=1e-8)


def test_the_metric_decides_which_neurons_go():
    # Two outputs; the metric weighs only the first, so a neuron writing only the second goes first under it.
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((200, 3))
    down = np.array([[1.0, 0.0], [0.0, 5.0], [0.5, 0.0]])
    kept_fisher, _ = prune.prune_neurons(hidden.T @ hidden, down, 2, np.diag([1.0, 0.0]), damping=0.0)
    kept_squared, _ = prune.prune_neurons(hidden.T @ hidden, down, 2, damping=0.0)
    assert kept_fisher.tolist() == [0, 2] and kept_squared.tolist() == [0, 1]


def test_a_silent_neuron_goes_first_with_the_default_damping():
    hidden, down, _ = _problem(6)
    hidden[:, 4] = 0.0  # never fires on this text: a zero row and column of HᵀH
    kept, rows = prune.prune_neurons(hidden.T @ hidden, down, hidden.shape[1] - 1)
    assert 4 not in kept and np.all(np.isfinite(rows))


def test_bad_arguments_name_what_is_wrong():
    hidden, down, metric = _problem(7)
    gram = hidden.T @ hidden
    for keep_count in (0, 14, 3.0, True):
        with pytest.raises(ValueError, match=r"keep_count: got .* expected an int in \[1, 13\]"):
            prune.prune_neurons(gram, down, keep_count)
    with pytest.raises(ValueError, match=r"expected gram \[I, I\] and down \[I, N\]"):
        prune.prune_neurons(gram[:-1, :-1], down, 5)
    with pytest.raises(ValueError, match=r"output_gram: got shape \(6, 6\), expected \[7, 7\]"):
        prune.prune_neurons(gram, down, 5, metric[:-1, :-1])
    with pytest.raises(ValueError, match="damping: got -1"):
        prune.prune_neurons(gram, down, 5, damping=-1)
    for per_round in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"per_round: got .* expected a positive int"):
            prune.prune_neurons(gram, down, 5, per_round=per_round)

"""`grouped.spread_rows` / `unsort_rows`: the MoE rows' permutations with gradients that
gather instead of scattering (XLA:GPU runs a scatter-add with atomics: 100 of the dropless
step's 777 busy ms on an H200). Values and gradients against autodiff of the plain gathers
(exact: the same additions), and no scatter in the program the backward asks XLA for."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.model.grouped import inverse, sort_rows, spread_rows, unsort_rows

T, K, E, D = 12, 3, 5, 8


def _routing():
    experts = jax.random.randint(jax.random.key(0), (T * K,), 0, E)
    keep = jax.random.uniform(jax.random.key(1), (T * K,)) < 0.8  # some dropped
    order, sizes = sort_rows(experts, keep, E)
    return order, inverse(order), int(jnp.sum(sizes))


def test_spread_rows_equals_the_plain_gather_values_and_gradient():
    order, inv, S = _routing()
    x = jax.random.normal(jax.random.key(2), (T, D))
    dy = jax.random.normal(jax.random.key(3), (S, D))
    plain = lambda x: x[order[:S] // K]
    ours = lambda x: spread_rows(x, order[:S], inv, K)
    np.testing.assert_array_equal(ours(x), plain(x))
    got, want = jax.vjp(ours, x)[1](dy)[0], jax.vjp(plain, x)[1](dy)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_gather_rows_equals_the_plain_gather_values_and_gradient():
    order, inv, S = _routing()
    y = jax.random.normal(jax.random.key(4), (S, D))
    dy = jax.random.normal(jax.random.key(5), (T * K, D))
    plain = lambda y: y.at[inv].get(mode="fill", fill_value=0)
    ours = lambda y: unsort_rows(y, inv, order[:S])
    np.testing.assert_array_equal(ours(y), plain(y))
    assert not np.any(np.asarray(ours(y))[np.asarray(inv) >= S]), "dropped rows read zeros"
    got, want = jax.vjp(ours, y)[1](dy)[0], jax.vjp(plain, y)[1](dy)[0]
    np.testing.assert_array_equal(got, want)


def test_their_backward_asks_for_no_scatter():
    order, inv, S = _routing()
    x = jnp.ones((T, D))

    def both(x):
        rows = spread_rows(x, order[:S], inv, K)
        return jnp.sum(unsort_rows(rows * 2, inv, order[:S]) ** 2)

    # what the program asks XLA for (compiled, XLA:CPU may expand a scatter into a loop)
    scatters = lambda f: re.findall(r"stablehlo\.scatter", jax.jit(jax.grad(f)).lower(x).as_text())
    assert not scatters(both)
    plain = lambda x: jnp.sum((x[order[:S] // K] * 2).at[inv].get(mode="fill", fill_value=0) ** 2)
    assert scatters(plain)  # what they replace

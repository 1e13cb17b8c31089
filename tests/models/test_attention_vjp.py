"""The hand-written backward passes of the JAX oracles against autodiff and torch autograd.

`layers._masked_attention` (the masked attention core, custom VJP) and `lora._adapted` (the LoRA linear, custom
VJP) each replace what XLA would derive; both must give the gradients autodiff gives on the plain definition and
torch autograd gives on the torch twin's math, within fp32 noise. Masks include fully masked rows (left padding)
and a sliding window, where every masked probability must be exactly zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_oracles.models import layers
from jax_oracles.training import lora

jax.config.update("jax_default_matmul_precision", "highest")
TOL = dict(rtol=2e-5, atol=2e-6)


def _plain_attention(q, k, v, mask, scale):  # autodiff's own backward of torch's math (masked_fill as a where)
    B, T, N, H = q.shape
    K = k.shape[2]
    s = jnp.einsum("BTKGH,BSKH->BKGTS", q.reshape(B, T, K, N // K, H), k) * scale
    s = jnp.where(mask[:, None, None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("BKGTS,BSKH->BTKGH", jax.nn.softmax(s, -1), v).reshape(B, T, N, H)


def _torch_attention(q, k, v, mask, scale):  # transformers' eager_attention_forward: repeat_kv, masked_fill
    G = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[:, None], torch.finfo(s.dtype).min)
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def _case(seed, B=2, T=20, N=6, K=2, H=8, window=None):
    rng = np.random.default_rng(seed)
    q, k, v, w = (rng.standard_normal(s).astype(np.float32) for s in
                  [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)])
    keys = np.ones((B, T), bool)
    keys[1, :5] = False  # left padding: the first rows of sequence 1 see no key at all
    mask = layers.causal_mask(jnp.asarray(keys), window)
    return q, k, v, w, np.asarray(mask)


@pytest.mark.parametrize("window", [None, 4])
def test_masked_attention_vjp_matches_autodiff_and_torch(window):
    q, k, v, w, mask = _case(0, window=window)
    scale = 8 ** -0.5

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask, scale) * w)
    out = layers.eager_attention(q, k, v, mask, scale)
    grads = jax.grad(loss(layers.eager_attention), argnums=(0, 1, 2))(q, k, v)
    ref_out = _plain_attention(q, k, v, mask, scale)
    ref_grads = jax.grad(loss(_plain_attention), argnums=(0, 1, 2))(q, k, v)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    t_out = _torch_attention(tq, tk, tv, torch.from_numpy(mask), scale)
    (t_out * torch.from_numpy(w)).sum().backward()

    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), **TOL)
    np.testing.assert_allclose(np.asarray(out), t_out.detach().numpy(), **TOL)
    for name, g, r, t in zip("qkv", grads, ref_grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **TOL, err_msg=f"d{name} vs autodiff")
        np.testing.assert_allclose(np.asarray(g), t.numpy(), **TOL, err_msg=f"d{name} vs torch")
    # No score a mask hides passes gradient (masked_fill): the padded keys of sequence 1 get dk = 0. Their dv is
    # not 0: a row that sees no key at all has a uniform softmax over every key, in torch as here.
    assert not np.asarray(grads[1])[1, :5].any() and np.asarray(grads[2])[1, :5].any()


def test_lora_linear_vjp_matches_autodiff():
    rng = np.random.default_rng(1)
    x, kernel, a, b, g = (rng.standard_normal(s).astype(np.float32) for s in
                          [(3, 7, 16), (16, 24), (16, 4), (4, 24), (3, 7, 24)])
    bias = rng.standard_normal(24).astype(np.float32)
    scaling = 2.0

    def plain(x, kernel, bias, a, b):
        return x @ kernel + bias + scaling * (x @ a) @ b
    args = (x, kernel, bias, a, b)
    ours = jax.vjp(lambda *p: lora._adapted(*p, scaling), *args)
    ref = jax.vjp(plain, *args)
    np.testing.assert_allclose(np.asarray(ours[0]), np.asarray(ref[0]), **TOL)
    for name, mine, theirs in zip(("x", "kernel", "bias", "lora_a", "lora_b"), ours[1](g), ref[1](g)):
        theirs = np.asarray(theirs)  # sums of ~30 terms of size ~10: fp32 noise relative to the largest entry
        np.testing.assert_allclose(np.asarray(mine), theirs, rtol=0, atol=1e-6 * np.abs(theirs).max(),
                                   err_msg=f"d{name}")

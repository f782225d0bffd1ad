"""Activation memory on CPU: what a function's VJP saves for the backward pass."""
from __future__ import annotations

import math

import jax
import numpy as np


def _same(a, b) -> bool:
  return (a.shape == b.shape and a.dtype == b.dtype and bool(jax.numpy.array_equal(a, b)))


def _residual_leaves(f, *args, exclude_args=True):
  _, pullback = jax.vjp(f, *args)
  arg_leaves = jax.tree_util.tree_leaves(args) if exclude_args else []
  arg_ids = {id(a) for a in arg_leaves}
  seen, out = set(), []
  for leaf in jax.tree_util.tree_leaves(pullback):
    if not hasattr(leaf, "dtype") or id(leaf) in seen or id(leaf) in arg_ids:
      continue
    if any(_same(leaf, a) for a in arg_leaves):  # an input re-materialized (e.g. astype copy).
      continue
    seen.add(id(leaf))
    out.append(leaf)
  return out


def saved_residuals(f, *args, exclude_args=True):
  """List of (shape, dtype) of the arrays f's pullback keeps (deduped, args excluded)."""
  return [(tuple(a.shape), np.dtype(a.dtype)) for a in _residual_leaves(f, *args,
                                                                        exclude_args=exclude_args)]


def saved_residual_bytes(f, *args, exclude_args=True) -> int:
  """Total bytes of the arrays f's pullback keeps."""
  return sum(math.prod(s) * d.itemsize for s, d in saved_residuals(f, *args,
                                                                  exclude_args=exclude_args))

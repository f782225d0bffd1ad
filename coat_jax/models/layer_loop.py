"""The scanned decoder blocks' loop with a VJP of its own (`LlamaConfig.scan_impl="vjp_loop"`).

JAX differentiates a `lax.scan` by stacking every per-layer residual of the body into an
(L, ...) output that it zero-fills before the loop; `layer_loop` keeps the residuals in carried
buffers that start uninitialized (`lax.empty`: XLA's AllocateBuffer on GPU, zeros on CPU) and keeps
no parameter slice, constant or repeated array among them (tests/test_scan_residuals.py).

With `grads_into` the backward adds the layers' gradients into a given tree instead of writing
them into fresh buffers: gradient accumulation passes its running sum there, so no microbatch
gradient of the stack exists beside it (coat_jax/training/accumulate.py).
"""
from __future__ import annotations

import jax


def layer_loop(fn, x, stacked, unroll: int = 1, grads_into=None):
  """x -> fn(... fn(fn(x, p[0]), p[1]) ..., p[L-1]) over the leading axis of `stacked`, with a VJP
  of its own: the forward loop keeps each layer's `jax.vjp` residuals in (L, ...) buffers made
  with `lax.empty` (uninitialized on GPU, where JAX's scan zero-fills its stacks), leaving out
  residuals that are the layer's own parameter slices (the backward re-slices them), that are
  constants, or that repeat an array already kept; the backward loop runs the pullbacks in
  reverse and writes the parameter gradients into `lax.empty` buffers. Same values as
  `lax.scan`; `fn` is a pure function (x, layer params) -> x of x's shape and dtype.

  grads_into: None, or a tree of `stacked`'s structure, shapes and dtypes, G. The backward's
  gradient buffers then start as G and layer i writes G[i] + dL/dp[i] (in G's dtype) over it, so
  the cotangent returned for `stacked` is

    G + dL/dstacked      (by design: not the gradient alone),

  and G's own cotangent is zero (pass it undifferentiated). The backward loop's carry starts as
  G's own buffers: where nothing reads G afterwards (a running gradient sum), XLA updates them in
  place and no second stacked-gradient tree is allocated.
  """
  n = jax.tree.leaves(stacked)[0].shape[0]
  if grads_into is not None:
    check_grads_into(stacked, grads_into)
  take = lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree)
  plan = {}  # filled while the forward traces, read by the backward

  def layer(x, p):
    """(y, kept residual arrays); records in `plan` where each pullback leaf comes from."""
    y, pullback = jax.vjp(fn, x, p)
    leaves, plan["tree"] = jax.tree.flatten(pullback)
    p_leaves, kept, where = jax.tree.leaves(p), [], []
    for leaf in leaves:
      src = next((("param", k) for k, q in enumerate(p_leaves) if q is leaf), None)
      src = src or next((("kept", k) for k, q in enumerate(kept) if q is leaf), None)
      if src is None and not isinstance(leaf, jax.core.Tracer):
        src = ("const", leaf)
      if src is None:
        src = ("kept", len(kept))
        kept.append(leaf)
      where.append(src)
    plan["where"] = where
    return y, kept

  def pullback_of(kept, p):
    leaves = [kept[k] if kind == "kept" else jax.tree.leaves(p)[k] if kind == "param" else k
              for kind, k in plan["where"]]
    return jax.tree.unflatten(plan["tree"], leaves)

  @jax.custom_vjp
  def run(x, stacked, grads_into):
    return jax.lax.scan(lambda c, p: (fn(c, p), None), x, stacked)[0]

  def run_fwd(x, stacked, grads_into):
    _, shapes = jax.eval_shape(layer, x, take(stacked, 0))
    bufs = [jax.lax.empty((n, *s.shape), s.dtype) for s in shapes]

    def body(i, carry):
      x, bufs = carry
      y, kept = layer(x, take(stacked, i))
      return y, [jax.lax.dynamic_update_index_in_dim(b, r, i, 0) for b, r in zip(bufs, kept)]

    x, bufs = jax.lax.fori_loop(0, n, body, (x, bufs), unroll=unroll)
    return x, (bufs, stacked, grads_into)

  def run_bwd(res, g):
    bufs, stacked, grads_into = res
    if grads_into is None:
      grads = jax.tree.map(lambda a: jax.lax.empty(a.shape, a.dtype), stacked)
    else:
      grads = grads_into

    def body(j, carry):
      g, grads = carry
      i = n - 1 - j
      p = take(stacked, i)
      gx, gp = pullback_of([jax.lax.dynamic_index_in_dim(b, i, 0, False) for b in bufs], p)(g)
      if grads_into is not None:   # G[i] + dL/dp[i]
        gp = jax.tree.map(lambda d, v: jax.lax.dynamic_index_in_dim(d, i, 0, False)
                          + v.astype(d.dtype), grads, gp)
      grads = jax.tree.map(lambda d, v: jax.lax.dynamic_update_index_in_dim(d, v.astype(d.dtype),
                                                                            i, 0), grads, gp)
      return gx, grads

    gx, grads = jax.lax.fori_loop(0, n, body, (g, grads), unroll=unroll)
    return gx, grads, None   # None: a zero cotangent for grads_into

  run.defvjp(run_fwd, run_bwd)
  return run(x, stacked, grads_into)


def check_grads_into(stacked, grads_into) -> None:
  """Raises ValueError unless `grads_into` has `stacked`'s tree structure, shapes and dtypes (a
  custom VJP's cotangent must have its primal's dtype, so the sum cannot change it)."""
  want, got = jax.tree.structure(stacked), jax.tree.structure(grads_into)
  if want != got:
    raise ValueError(f"layer_loop: grads_into must have the structure of the stacked params "
                     f"{want}, got {got}")
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(stacked)[0],
                          jax.tree.leaves(grads_into)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(f"layer_loop: grads_into{jax.tree_util.keystr(path)} is "
                       f"{b.dtype}{list(b.shape)}, the stacked param is {a.dtype}{list(a.shape)}: "
                       f"shapes and dtypes must be equal")

"""Kernels inside sharded jax.jit (8 simulated CPU devices, interpret mode): each device runs
the kernel on its local shard (coat_jax.kernels.sharded), and results equal the single-device run
bit for bit (the per-group / per-row math does not depend on how the rows are split; the
per-tensor amax is the global max either way)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from coat_jax import kernels, optim, quantize
from coat_jax.kernels import sharded
from tests import adam_standin

MESHES = [{"data": 8}, {"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}]
E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def _mesh(axes):
  return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _row_col_spec(axes):
  """Activations: rows over the batch axes, columns over "tensor" (as coat_jax.sharding)."""
  batch = tuple(a for a in ("data", "fsdp") if a in axes)
  return P(batch if batch else None, "tensor" if "tensor" in axes else None)


def _param_spec(axes):
  """A column-parallel weight (in, out): ("fsdp", "tensor"), as q_proj in coat_jax.sharding."""
  return P("fsdp" if "fsdp" in axes else None, "tensor" if "tensor" in axes else None)


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype.itemsize == 1 else \
      np.asarray(a)


def _assert_same(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _assert_same_values(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# One mesh (all three axes): in interpret mode the quantize kernels are not run per shard, so more
# meshes would only repeat XLA's partitioning of the same interpreted ops.
@pytest.mark.parametrize("axes", MESHES[-1:], ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
def test_quantize_ops_on_mesh_equal_single_device(rng, axes):
  mesh = _mesh(axes)
  x = jnp.asarray(rng.standard_normal((32, 256)) * np.exp2(rng.integers(-6, 6, (32, 256))),
                  jnp.float32)
  xs = jax.device_put(x, NamedSharding(mesh, _row_col_spec(axes)))
  with kernels.backend("pallas"):
    group = jax.jit(lambda a: kernels.quantize_per_group(a, 16, "e4m3"))
    tensor = jax.jit(lambda a: kernels.quantize_per_tensor(a, "e5m2", with_transpose=True))
    deq = jax.jit(lambda q: kernels.dequantize(q, jnp.float32))
    qg, qt = group(xs), tensor(xs)
    back = deq(qg)
    # single device: the same kernels on the whole (unsharded) array
    want_g, want_t = group(x), tensor(x)
    want_back = deq(want_g)
  # Values equal; the sign of a zero code may differ: XLA:CPU's partitioned interpreted kernel
  # rounds a tiny negative quotient to +0 where the single-device run gives -0 (CPU only).
  _assert_same_values((qg.data, qg.scale), (want_g.data, want_g.scale))
  amax = jnp.max(jnp.abs(x))
  want_scale = jax.jit(lambda a: quantize.scale_from_amax(a, "e5m2", 1e-10))(amax)
  np.testing.assert_array_equal(np.asarray(qt.scale), np.asarray(want_scale))   # global amax
  _assert_same_values((qt.data, qt.data_t), (want_t.data, want_t.data_t))
  _assert_same_values(back, want_back)
  u = jnp.flip(x, 0)
  us = jax.device_put(u, NamedSharding(mesh, _row_col_spec(axes)))
  with kernels.backend("pallas"):   # SwiGLU's fused forward: h, amax (global), gate/up codes
    swiglu = jax.jit(lambda g, u: kernels.swiglu_quantize(g, u))
    got, want = swiglu(xs, us), swiglu(x, u)
  _assert_same_values(got, want)
  # In interpret mode the Mosaic GPU kernels are not wrapped per shard (their ordered callbacks
  # cannot pass custom_partitioning; XLA partitions the interpreted ops), so locality (no
  # all-gather) is only a property of the GPU run; the per-shard wrapper is exercised here by
  # the Adam step below (its kernel stood in for by the jnp reference: tests/adam_standin.py).


def test_split_cutting_groups_is_named_in_an_error(rng):
  """A last axis split so that shards cut groups: `local_spec` keeps the last axis whole for a row
  kernel, and state_shardings (with the per-shard kernel in use) names the parameter and split."""
  mesh = _mesh({"fsdp": 2, "tensor": 4})
  assert sharded.local_spec(mesh, P(None, "tensor"), (16, 256), 128) == (None, None)
  assert sharded.local_spec(mesh, P(None, "tensor"), (16, 512), 128) == (None, "tensor")
  params = {"wide": jnp.zeros((64, 512)), "narrow": jnp.zeros((64, 256))}
  state = jax.jit(optim.coat_adamw(1e-3).init)(params)
  p_sh = {n: NamedSharding(mesh, P("fsdp", "tensor")) for n in params}
  with kernels.backend("adam=triton"), pytest.raises(ValueError,
                                                     match=r"\['narrow'\].*split 4 ways"):
    optim.state_shardings(p_sh, state)
  with kernels.backend("reference"):   # the reference step takes any split
    sh = optim.state_shardings(p_sh, state)
  assert sh.mu["narrow"].data.spec == P("fsdp", "tensor")


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
def test_coat_adamw_on_mesh_equals_single_device(rng, axes, monkeypatch):
  """Two steps of coat_adamw (the Adam kernel per shard: its jnp stand-in, tests/adam_standin.py)
  with params sharded like a column-parallel weight: bit-exact with the unsharded run; the kernel
  sees local shards only; each device holds 1/(fsdp * tensor) of the FP8 state bytes (data
  replicates)."""
  shapes = adam_standin.install(monkeypatch)
  mesh = _mesh(axes)
  params = {"w": jnp.asarray(rng.standard_normal((64, 512)) * 0.1, jnp.float32),
            "b": jnp.asarray(rng.standard_normal((8,)), jnp.float32)}
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 1e-2, jnp.float32),
                        params) for _ in range(2)]
  opt = optim.coat_adamw(1e-2, min_quantized_size=1024)
  p_sh = {"w": NamedSharding(mesh, _param_spec(axes)), "b": NamedSharding(mesh, P())}
  state = jax.jit(opt.init)(params)
  s_sh = optim.state_shardings(p_sh, state)

  def run(params, state, shard):
    step = jax.jit(lambda g, s, p: opt.update(g, s, p))
    if shard:
      params, state = jax.device_put(params, p_sh), jax.device_put(state, s_sh)
    for g in grads:
      g = jax.device_put(g, p_sh) if shard else g
      if shard:   # per shard on the local moments: no FP8 state or param is gathered
        hlo = step.lower(g, state, params).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo
      u, state = step(g, state, params)
      params = jax.tree.map(lambda p, u: p + u, params, u)
    return params, state

  with kernels.backend("adam=triton"):
    want = run(params, state, False)
    assert shapes and set(shapes) == {(64, 512)}, shapes   # the whole leaf
    del shapes[:]
    got = run(params, state, True)
  assert (64 // axes.get("fsdp", 1), 512 // axes.get("tensor", 1)) in shapes, shapes   # a shard
  # "w" (the stand-in kernel per shard: XLA's float32 log2 / exp2, compiled into a different
  # program when partitioned): the step to 1e-4 of its largest value, amax to float32 rounding,
  # FP8 codes equal but for rare one-code flips. "b" (float32 moments): float32 rounding.
  pick = lambda t, name: (t[0][name], t[1].mu[name], t[1].nu[name])
  step = np.asarray(want[0]["w"]) - np.asarray(params["w"])
  np.testing.assert_allclose(np.asarray(got[0]["w"]), np.asarray(want[0]["w"]), rtol=0,
                             atol=1e-4 * np.abs(step).max())
  for g_mom, w_mom in ((got[1].mu["w"], want[1].mu["w"]), (got[1].nu["w"], want[1].nu["w"])):
    np.testing.assert_array_equal(np.asarray(g_mom.k_code), np.asarray(w_mom.k_code))
    np.testing.assert_allclose(np.asarray(g_mom.amax), np.asarray(w_mom.amax), rtol=1e-5)
    codes = [_bits(m.data).astype(np.int32) for m in (g_mom, w_mom)]
    assert np.mean(codes[0] == codes[1]) > 0.99 and np.abs(codes[0] - codes[1]).max() <= 1
  for a, b in zip(pick(got, "b"), pick(want, "b")):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.0**-22, atol=0)
  mu = got[1].mu["w"]
  assert isinstance(mu, optim.ExpandedMoment)
  assert mu.data.sharding.is_equivalent_to(p_sh["w"], 2)
  shards = axes.get("fsdp", 1) * axes.get("tensor", 1)
  for moment in (got[1].mu["w"], got[1].nu["w"]):
    for leaf in moment:
      total = leaf.size * leaf.dtype.itemsize
      for shard in leaf.addressable_shards:
        assert shard.data.size * leaf.dtype.itemsize * shards == total


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("parallel", ["column", "row"])
def test_fp8_gemm_on_mesh_equals_single_device(rng, axes, parallel):
  """x (tokens, K) over the batch axes times an FSDP + tensor-parallel weight, through
  kernels.fp8_dot_general (TN). Column-parallel: w (N, K) split ("tensor", "fsdp"); row-parallel:
  ("fsdp", "tensor"), K split over "tensor". On CPU the interpreted kernel is partitioned by XLA;
  a split K sums partial products in another order, so the bound is float32 accumulation
  (relative 1e-6), bit-exact otherwise."""
  mesh = _mesh(axes)
  x = kernels.quantize_per_tensor(jnp.asarray(rng.standard_normal((256, 256)), jnp.float32))
  w = kernels.quantize_per_tensor(jnp.asarray(rng.standard_normal((128, 256)), jnp.float32))
  t = "tensor" if "tensor" in axes else None
  f = "fsdp" if "fsdp" in axes else None
  w_spec = P(t, f) if parallel == "column" else P(f, t)
  put = lambda q, spec: quantize.QuantizedArray(jax.device_put(q.data, NamedSharding(mesh, spec)),
                                                q.scale, q.fmt, 0)
  dn = (((1,), (1,)), ((), ()))
  gemm = jax.jit(lambda a, b: kernels.fp8_dot_general(a, b, dn, jnp.float32))
  with kernels.backend("pallas"):
    want = gemm(x, w)
    got = gemm(put(x, P(_row_col_spec(axes)[0])),
               put(w, w_spec))
  ref = np.asarray(x.data, np.float64) @ np.asarray(w.data, np.float64).T * float(x.scale * w.scale)
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6,
                             atol=1e-6 * float(jnp.abs(want).max()))


# coat on every mesh; the other modes on the FSDP + TP mesh (interpret mode: ~10-15 s each).
# CI time: coat runs with --slow on all four meshes: tests/test_mesh_llama_train.py trains a coat
# Llama with the kernels (interpret mode) on the same four meshes in CI, through these layers
# (column-parallel q / gate / up, row-parallel o / down; forward and both gradients).
LINEAR_CASES = [("coat", a) for a in MESHES] + [(m, MESHES[2]) for m in ("bf16", "fp8_linear")]


@pytest.mark.parametrize("mode,axes", [
    pytest.param(m, a, id=f"{m}-" + "x".join(f"{k}{v}" for k, v in a.items()),
                 marks=[pytest.mark.slow] if m == "coat" else [])
    for m, a in LINEAR_CASES])
def test_linear_fsdp_tp_on_mesh_equals_single_device(rng, axes, mode):
  """A column-parallel then a row-parallel linear (as q_proj / o_proj: w_in ("fsdp", "tensor"),
  w_out ("tensor", "fsdp")), forward and both gradients, kernels forced on (per shard; the GEMM's
  interpreted ops partitioned by XLA on CPU). Per-tensor scales are global, so the FP8 operands
  equal the single-device ones; sums over split axes may be reordered (the row-parallel product,
  the FSDP gradient reduction), hence float32 tolerances: 1e-5 relative to each result's max."""
  from coat_jax import ops
  mesh = _mesh(axes)
  x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
  w_in = jnp.asarray(rng.standard_normal((128, 256)) / 11, jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((256, 128)) / 16, jnp.float32)
  r = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)

  def loss(x, w_in, w_out):
    y = ops.linear(ops.linear(x, w_in, mode=mode), w_out, mode=mode)
    return jnp.sum(y * r), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  t = "tensor" if "tensor" in axes else None
  f = "fsdp" if "fsdp" in axes else None
  sh = [NamedSharding(mesh, P(_row_col_spec(axes)[0], None)), NamedSharding(mesh, P(f, t)),
        NamedSharding(mesh, P(t, f))]
  # the sharded step returns each gradient sharded like its input (FSDP: reduce-scattered)
  sharded_step = jax.jit(step, out_shardings=((NamedSharding(mesh, P()), sh[0]), tuple(sh)))
  with kernels.backend("pallas"):
    (_, want_y), want_g = step(x, w_in, w_out)
    (_, got_y), got_g = sharded_step(*(jax.device_put(a, s) for a, s in zip((x, w_in, w_out),
                                                                          sh)))
  for a, b in zip((got_y, *got_g), (want_y, *want_g)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())

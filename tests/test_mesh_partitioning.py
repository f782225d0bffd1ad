"""The partitioning switch (kernels.partitioning: `auto` wraps Pallas calls for meshes only with
several devices, `always` on one device too) and the partitioned FP8 GEMM (sharded.matmul_tn).

On one device custom_partitioning lowers its function inline, so `always` must give exactly the
unwrapped results (bit for bit), the per-tensor quantize's transposed copy included (the kernel
writes it, sharded.transposing: per shard on a mesh). Interpret mode (CPU) never wraps the Mosaic
GPU kernels (their ordered callbacks cannot pass custom_partitioning), so matmul_tn and the
per-tensor quantize are tested here with XLA kernels of the same contracts, also through the
dispatch with them standing in for the Mosaic ones. The GPU test runs the real kernel (lead: JAX_PLATFORMS=cuda pytest -m gpu)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from coat_jax import formats, kernels, ops, optim, quantize
from coat_jax.kernels import backends
from coat_jax.kernels import sharded
from tests import adam_standin

F32 = jnp.float32
# Tests here fake a GPU (interpret_mode False) on the CPU, where jax-triton is not installed: the
# optimizer family's dispatch then warns once that it runs the reference, which is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*jax-triton is not installed")


def _mesh(axes, devices=None):
  devices = jax.devices()[:int(np.prod(list(axes.values())))] if devices is None else devices
  return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                       devices=devices)


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype.itemsize == 1 else \
      np.asarray(a)


def _assert_same(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_partitioning_switch_is_validated_and_keys_the_jit_cache(monkeypatch):
  with pytest.raises(ValueError, match="unknown kernel partitioning 'sometimes'"):
    kernels.partitioning("sometimes")
  assert kernels.current_partitioning() == "auto"
  traces = []

  @jax.jit
  def f(x):
    traces.append(kernels.current_partitioning())
    return x + 1

  monkeypatch.setattr(jax, "device_count", lambda *a: 1)   # one device: only `always` wraps
  assert not kernels.per_shard()
  f(1.0)
  with kernels.partitioning("always"):
    assert kernels.per_shard()
    f(1.0)
  f(1.0)
  assert traces == ["auto", "always"]


def test_always_wraps_row_kernels_on_one_device_bit_exactly(rng, monkeypatch):
  """quantize (per group, per tensor + transpose), dequantize and a coat_adamw step with the
  fused kernel (on the CPU its jnp stand-in, tests/adam_standin.py), on one device: `always`
  (wrapped, inlined) == unwrapped, bit for bit."""
  monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  if kernels.interpret_mode():
    adam_standin.install(monkeypatch)
  dev = jax.devices()[0]
  x = jax.device_put(jnp.asarray(rng.standard_normal((16, 128)) *
                                 np.exp2(rng.integers(-5, 5, (16, 128))), F32), dev)
  params = {"w": jax.device_put(jnp.asarray(rng.standard_normal((8, 128)) * 0.1, F32), dev)}
  grads = {"w": jnp.asarray(rng.standard_normal((8, 128)) * 1e-2, F32)}
  opt = optim.coat_adamw(1e-2, min_quantized_size=256)

  def quant(a):
    g = kernels.quantize_per_group(a, 16, "e4m3")
    t = kernels.quantize_per_tensor(a, "e5m2", with_transpose=True)
    return g.data, g.scale, kernels.dequantize(g, F32), t.data, t.data_t, t.scale

  def adam(p):
    u, s = opt.update(grads, opt.init(p), p)
    return jax.tree.map(jnp.add, p, u), s

  calls = []
  for name in ("rowwise", "transposing"):
    real = getattr(sharded, name)
    monkeypatch.setattr(sharded, name, lambda *a, real=real: calls.append(1) or real(*a))
  results = {}
  pallas = "pallas" if not kernels.interpret_mode() else (
      "gemm=pallas,quantize=pallas,dequantize=pallas,adam=triton")
  with kernels.backend(pallas):
    for mode in ("auto", "always"):
      with kernels.partitioning(mode):
        results[mode] = (jax.jit(quant)(x), jax.jit(adam)(params))
      # wrapped: 2 per-tensor (tile maxima, quantize + transpose), 1 per-group, 1 dequantize,
      # 1 Adam step; in interpret mode (CPU) the Mosaic GPU quantize kernels are not wrapped
      # (coat_jax.kernels.quantize): only the Adam step is.
      wrapped = 1 if kernels.interpret_mode() else 5
      assert len(calls) == (wrapped if mode == "always" else 0)
  _assert_same(results["always"], results["auto"])
  assert np.isfinite(np.asarray(results["always"][1][0]["w"])).all()


def _xla_quantize_per_tensor(calls, x, *, out_dtype, fmax, floor, scale, with_transpose=False,
                             interpret=None, **_):
  """The Mosaic per-tensor quantize's contract (given the scale) in XLA, logging (shape,
  with_transpose) per trace; the transposed codes are quantized from the transposed input."""
  calls.append((x.shape, with_transpose))
  fmt = "e4m3" if jnp.dtype(out_dtype) == jnp.float8_e4m3fn else "e5m2"
  assert float(jnp.finfo(out_dtype).max) == fmax
  q = lambda v: formats.saturating_cast(v.astype(F32) / scale, fmt)
  return q(x), scale, q(jnp.swapaxes(x, -1, -2)) if with_transpose else None


@pytest.mark.parametrize("axes,shape,spec,fused", [
    ({}, (256, 128), None, True),                                      # one device, `always`
    ({"fsdp": 4, "tensor": 2}, (8, 64, 128), P("fsdp"), True),         # last two axes unsplit
    ({"fsdp": 4, "tensor": 2}, (256, 128), P("fsdp", "tensor"), True),  # split: (64, 64) shards
    ({"fsdp": 4, "tensor": 2}, (128, 128), P("fsdp", "tensor"), False),  # (32, 64): no kernel
], ids=["one-device", "unsplit", "split", "split-reference"])
def test_per_tensor_quantize_writes_transposed_copy_per_shard(rng, monkeypatch, axes, shape, spec,
                                                               fused):
  """kernels.quantize_per_tensor(with_transpose=True) on the sharded path (the Mosaic kernels
  replaced by their XLA contracts, as on a GPU): each shard's kernel writes its codes and their
  transpose (traced with the shard's shape and with_transpose=True; no transpose of FP8 codes
  outside the kernel in the jaxpr), data_t is sharded like data with the last two axes swapped,
  no gather; a shard the kernel does not take is quantized by the reference and transposed
  locally. Codes and scale equal the unwrapped single-device run bit for bit (global amax)."""
  from pallas_kernels.quantize import quantize_mgpu as qm
  calls = []
  monkeypatch.setattr(qm, "quantize_per_tensor",
                      lambda *a, **k: _xla_quantize_per_tensor(calls, *a, **k))
  monkeypatch.setattr(qm, "tile_amax", lambda x, **_: quantize.group_amax(x, qm.STAGE1_TILE))
  monkeypatch.setattr(backends, "interpret_mode", lambda: False)
  x = jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-5, 5, shape)), jnp.bfloat16)
  quant = lambda a: kernels.quantize_per_tensor(a, "e5m2", with_transpose=True)
  f = jax.jit(quant)
  with kernels.backend("pallas"):
    with monkeypatch.context() as one, kernels.partitioning("auto"):
      one.setattr(jax, "device_count", lambda *a: 1)   # one device, unwrapped
      assert not kernels.per_shard()
      want = f(jax.device_put(x, jax.devices()[0]))
    assert calls == [(shape, True)]   # the kernel's fused transpose
    calls.clear()
    if not axes:
      monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    with kernels.partitioning("always"):
      if axes:
        mesh = _mesh(axes)
        xs = jax.device_put(x, NamedSharding(mesh, spec))
      else:
        xs = jax.device_put(x, jax.devices()[0])
      got = f(xs)
      eqns = jax.make_jaxpr(quant)(xs).jaxpr.eqns
      hlo = f.lower(xs).compile().as_text()
  assert ((xs.sharding.shard_shape(shape), True) in calls) == fused, calls
  assert not any(e.primitive.name == "transpose" for e in eqns), [e.primitive for e in eqns]
  assert sum(e.primitive.name == "custom_partitioning" for e in eqns) == 2   # amax, quantize
  _assert_same((got.data, got.data_t, got.scale), (want.data, want.data_t, want.scale))
  np.testing.assert_array_equal(_bits(got.data_t), _bits(jnp.swapaxes(got.data, -1, -2)))
  assert np.isfinite(np.asarray(got.data, F32)).all()
  if axes:
    s = tuple(spec) + (None,) * (len(shape) - len(spec))
    assert got.data.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), len(shape))
    assert got.data_t.sharding.is_equivalent_to(NamedSharding(mesh, P(*s[:-2], s[-1], s[-2])),
                                                len(shape))
    for op in ("all-gather", "all-to-all", "collective-permute"):   # the amax's all-reduce only
      assert op not in hlo


def _xla_tn(a, b, s, out_dtype=F32, interpret=None, b_scale=None, **_):
  """The Mosaic kernel's contract, (s * b_scale * a @ b.T).astype(out_dtype), in XLA (CPU)."""
  out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)
  return (out * (s if b_scale is None else s * b_scale)).astype(out_dtype)


@pytest.mark.parametrize("axes,a_spec,b_spec,partial", [
    ({"fsdp": 1}, P(), P(), False),                                   # a 1-device mesh
    ({"fsdp": 4, "tensor": 2}, P("fsdp"), P("tensor", "fsdp"), True),   # column-parallel, FSDP w
    ({"fsdp": 4, "tensor": 2}, P("fsdp", "tensor"), P(None, "tensor"), False),  # row: K gathered
    ({"fsdp": 4, "tensor": 2}, P("fsdp", "tensor"), P(None, "tensor"), True),   # row: K partials
    ({"fsdp": 4, "tensor": 2}, P(None, "fsdp"), P("tensor", "fsdp"), True),     # weight gradient
], ids=["one-device", "column", "row-gather", "row-psum", "wgrad-psum"])
def test_matmul_tn_per_shard(rng, axes, a_spec, b_spec, partial):
  """M keeps a's split, N b's. K is gathered (every shard's product a whole-K dot: equal to the
  unsharded result, exact), or with partial_kernel, kept split where M and N leave its axes
  free: float32 partial products summed by an all-reduce (another summation order: 1e-6)."""
  mesh = _mesh(axes)
  a = jnp.asarray(rng.standard_normal((64, 128)), F32).astype(jnp.float8_e4m3fn)
  b = jnp.asarray(rng.standard_normal((32, 128)), F32).astype(jnp.float8_e4m3fn)
  s = jnp.float32(rng.uniform(0.5, 2.0))
  want = _xla_tn(a, b, s, jnp.bfloat16)
  put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  kw = dict(partial_kernel=lambda *v: _xla_tn(*v, F32)) if partial else {}
  fn = jax.jit(lambda a, b, s: sharded.matmul_tn(lambda *v: _xla_tn(*v, jnp.bfloat16), a, b, s,
                                                 **kw))
  args = (put(a, a_spec), put(b, b_spec), put(s, P()))
  got = fn(*args)
  assert got.dtype == jnp.bfloat16
  split_k = partial and (a_spec[1:2] not in ((), (None,)))
  if split_k:   # bf16 results of float32 sums in another order: within one bf16 rounding
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want, F32), rtol=2**-8,
                               atol=1e-6 * float(jnp.abs(want.astype(F32)).max()))
  else:
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
  m = a_spec[0] if len(a_spec) else None
  n = b_spec[0] if len(b_spec) else None
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(m, n)), 2)
  if len(mesh.devices.flat) > 1:
    hlo = fn.lower(*args).compile().as_text()
    assert ("all-reduce" in hlo) == split_k
    assert ("all-gather" in hlo) != split_k
    assert "reduce-scatter" not in hlo


def test_coat_linear_through_matmul_tn(rng, monkeypatch):
  """ops.linear (coat) forward + both gradients with the dispatch on its compiled-GEMM path
  (`wrap`: matmul_tn), the Mosaic kernel replaced by its XLA contract: a column- then a
  row-parallel linear, partitioning `always`, equals the unwrapped single-device run."""
  from pallas_kernels.gemm import fp8_matmul
  monkeypatch.setattr(fp8_matmul, "fp8_matmul_tn", _xla_tn)
  monkeypatch.setattr(backends, "interpret_mode", lambda: False)
  calls = []
  real = sharded.matmul_tn
  monkeypatch.setattr(sharded, "matmul_tn", lambda *a, **k: calls.append(1) or real(*a, **k))
  axes = {"fsdp": 4, "tensor": 2}
  mesh = _mesh(axes)
  x = jnp.asarray(rng.standard_normal((128, 128)), F32)
  w_in = jnp.asarray(rng.standard_normal((128, 256)) / 11, F32)
  w_out = jnp.asarray(rng.standard_normal((256, 128)) / 16, F32)
  r = jnp.asarray(rng.standard_normal((128, 128)), F32)

  def loss(x, w_in, w_out):
    y = ops.linear(ops.linear(x, w_in, mode="coat"), w_out, mode="coat")
    return jnp.sum(y * r), y

  step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  f, t = "fsdp", "tensor"
  sh = [NamedSharding(mesh, P(f)), NamedSharding(mesh, P(f, t)), NamedSharding(mesh, P(t, f))]
  with kernels.backend("gemm=pallas,quantize=reference,dequantize=reference,adam=reference"):
    with kernels.partitioning("always"):
      (_, got_y), got_g = jax.jit(step)(*(jax.device_put(v, s)
                                          for v, s in zip((x, w_in, w_out), sh)))
    assert calls   # forward and backward GEMMs went through matmul_tn
    calls.clear()
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    (_, want_y), want_g = jax.jit(step)(*(jax.device_put(v, jax.devices()[0])
                                          for v in (x, w_in, w_out)))
    assert not calls
  for a, b in zip((got_y, *got_g), (want_y, *want_g)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    # whole-K products are exact; the FSDP gradient of x and the weights' reductions over the
    # batch shards are float32 sums in another order
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


@pytest.mark.gpu
def test_gpu_sharded_gemm_and_linear_equal_unsharded(rng):
  """Hopper: the Mosaic GEMM through matmul_tn (`always` on one GPU; with 2+ GPUs also an FSDP
  mesh of them) vs the unwrapped kernel: the GEMM bit for bit, the coat linear's forward and
  gradients bit for bit on one GPU; on a mesh dX within float32 reduction order and dW within
  the FP8 tensor cores' accumulation of the batch halves."""
  assert jax.default_backend() == "gpu"
  x = jnp.asarray(rng.standard_normal((512, 1024)), F32)
  w = jnp.asarray(rng.standard_normal((1024, 768)) / 32, F32)
  r = jnp.asarray(rng.standard_normal((512, 768)), F32)
  xq, wq = kernels.quantize_per_tensor(x), kernels.quantize_per_tensor(w.T)
  dn = (((1,), (1,)), ((), ()))
  gemm = lambda a, b: kernels.fp8_dot_general(a, b, dn, jnp.bfloat16)
  step = jax.value_and_grad(lambda x, w: jnp.sum(ops.linear(x, w, mode="coat") * r),
                            argnums=(0, 1))
  with kernels.backend("pallas"):
    want = jax.jit(gemm)(xq, wq), jax.jit(step)(x, w)
    with kernels.partitioning("always"):
      assert "custom_partitioning" in str(jax.make_jaxpr(gemm)(xq, wq))
      got = jax.jit(gemm)(xq, wq), jax.jit(step)(x, w)
    _assert_same(got, want)
    n = jax.device_count()
    if n > 1:
      mesh = _mesh({"fsdp": n})
      put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
      loss, (dx, dw) = jax.jit(step)(put(x, P("fsdp")), put(w, P("fsdp")))
      # the loss: a sum of 4e5 terms of both signs in another order (1e-3 relative)
      np.testing.assert_allclose(float(loss), float(want[1][0]), rtol=1e-3)
      # dX: no contraction is split (the weight is gathered): float32 reduction order only
      b = np.asarray(want[1][1][0], np.float64)
      np.testing.assert_allclose(np.asarray(dx, np.float64), b, rtol=0, atol=1e-5 * np.abs(b).max())
      # dW = x^T dY contracts the batch, which the mesh splits: each GPU's FP8 tensor cores sum
      # its half (Hopper's FP8 wgmma adds products at about 14 bits, not float32's 24; measured
      # on 2 H200s: 7e-4 of the largest |dW|), then the halves are added. Bound per element:
      # 2^-10 of the sum of the products' magnitudes, sum_m |x_mi| |dY_mj| (dY = r here); a
      # wrong shard, scale or sum would be off by about the value itself.
      bound = np.abs(np.asarray(x, np.float64)).T @ np.abs(np.asarray(r, np.float64))
      err = np.abs(np.asarray(dw, np.float64) - np.asarray(want[1][1][1], np.float64))
      assert np.isfinite(err).all() and (err <= 2.0**-10 * bound).all(), (
          f"max error / bound {np.max(err / bound):.3g} (allowed {2.0**-10:.3g})")


@pytest.mark.gpu
def test_gpu_transposing_quantize_equals_unwrapped(rng):
  """Hopper: the Mosaic per-tensor quantize with the transposed copy (bf16 input, the fused
  kernel) through sharded.transposing (`always` on one GPU; with 2+ GPUs also row-split over an
  FSDP mesh of them) equals the unwrapped kernel bit for bit."""
  assert jax.default_backend() == "gpu"
  x = jnp.asarray(rng.standard_normal((512, 1024)) * np.exp2(rng.integers(-6, 6, (512, 1024))),
                  jnp.bfloat16)
  quant = lambda a: kernels.quantize_per_tensor(a, "e4m3", with_transpose=True)
  with kernels.backend("pallas"):
    want = jax.jit(quant)(x)
    with kernels.partitioning("always"):
      assert "custom_partitioning" in str(jax.make_jaxpr(quant)(x))
      got = jax.jit(quant)(x)
    _assert_same((got.data, got.data_t, got.scale), (want.data, want.data_t, want.scale))
    n = jax.device_count()
    if n > 1:
      mesh = _mesh({"fsdp": n})
      got = jax.jit(quant)(jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
      _assert_same((got.data, got.data_t, got.scale), (want.data, want.data_t, want.scale))
      assert got.data_t.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 2)

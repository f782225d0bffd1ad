"""The dispatch (coat_jax.kernels): which implementation each family picks for which device and
shape (simulated: `backends.on_hopper`, `interpret_mode`, `triton_available` monkeypatched;
nothing runs), the KernelConfig and COAT_JAX_KERNELS forms of the choice,
and, in interpret mode on CPU, that the picked Mosaic GPU quantize kernels give the jitted jnp
references' results bit for bit while the shapes they do not take go to the reference."""
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import expansion, kernels, quantize
from coat_jax.kernels import adam as kernels_adam
from coat_jax.kernels import backends

ref_per_group = jax.jit(quantize.quantize_per_group, static_argnums=(1, 2))
ref_per_tensor = jax.jit(quantize.quantize_per_tensor, static_argnums=(1,),
                         static_argnames=("with_transpose",))
ref_dequantize = jax.jit(quantize.dequantize, static_argnums=(1,))


def _inputs(rng, shape, dtype):
  """Random values spanning many binades."""
  return jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape)), dtype)


def _bits(a):
  a = jnp.asarray(a)
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype.itemsize == 1 \
      else np.asarray(a)


def _assert_same(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _uses_kernel(fn, *args):
  """A Mosaic GPU kernel in the jaxpr: a pallas_call (GPU), or in interpret mode its inlined
  body, which names the kernel (coat_*_mgpu)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return "_mgpu" in text or "pallas_call" in text


@pytest.fixture
def gpu(monkeypatch):
  """A simulated Hopper GPU (compiled kernels, no interpret mode); returns a setter for whether
  jax-triton imports. Resets the one-time warnings."""
  monkeypatch.setattr(backends, "on_hopper", lambda: True)
  monkeypatch.setattr(backends, "interpret_mode", lambda: False)
  monkeypatch.setattr(backends, "_warned", set())
  monkeypatch.delenv(kernels.ENV, raising=False)
  return lambda ok: monkeypatch.setattr(backends, "triton_available", lambda: ok)


def test_auto_on_hopper_with_jax_triton_uses_every_kernel_but_dequantize(gpu):
  gpu(True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = {fam: kernels.implementation(fam) for fam in kernels.FAMILIES}
  # the GEMM too, on meshes as on one device (8 simulated devices on CPU); dequantize stays XLA's.
  assert got == {"gemm": "mosaic", "quantize": "mosaic", "dequantize": None, "adam": "triton"}
  with kernels.backend("pallas"):
    assert kernels.implementation("dequantize") == "mosaic"
    assert kernels.implementation("gemm") == "mosaic"


def test_without_jax_triton_the_optimizer_takes_the_reference_and_warns_once(gpu):
  gpu(False)
  with pytest.warns(RuntimeWarning, match=r"jnp reference.*pip install coat-jax\[gpu\]") as rec:
    assert kernels.implementation("adam") is None
  assert len(rec) == 1 and "\n" not in str(rec[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # once: the second call is silent
    assert kernels.implementation("adam") is None
    assert not kernels.use_pallas("adam")
    assert kernels.implementation("quantize") == "mosaic"


def test_off_hopper_auto_is_the_reference_and_pallas_interprets(monkeypatch):
  monkeypatch.setattr(backends, "on_hopper", lambda: False)
  monkeypatch.setattr(backends, "interpret_mode", lambda: True)
  monkeypatch.setattr(backends, "triton_available", lambda: True)
  monkeypatch.delenv(kernels.ENV, raising=False)
  assert all(kernels.implementation(f) is None for f in kernels.FAMILIES)
  assert not kernels.use_pallas("quantize")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with kernels.backend("pallas"):   # CPU: interpret mode, where Triton cannot run: no warning
      assert kernels.implementation("adam") is None
      assert kernels.implementation("quantize") == "mosaic" and kernels.use_pallas("quantize")


def test_named_implementations_and_bad_names(gpu):
  gpu(False)
  with kernels.backend("adam=triton,quantize=mosaic,dequantize=mosaic"):
    assert kernels.implementation("adam") == "triton"
    assert kernels.current_backend()["quantize"] == "mosaic"
    assert kernels.implementation("dequantize") == "mosaic"
  with kernels.backend("quantize=reference"):
    assert kernels.implementation("quantize") is None
  for bad in ("quantize=triton", "adam=mosaic", "adam=pallas_triton", "adam_tree=triton",
              "quantize=fast", "mosaic"):
    with pytest.raises(ValueError, match="unknown kernel backend"):
      kernels.backend(bad)
  with pytest.raises(ValueError, match="unknown kernel family"):
    kernels.implementation("gemv")


def test_kernel_config_is_checked_and_hashable():
  cfg = kernels.KernelConfig(backend="gemm=pallas", partitioning="always")
  assert hash(cfg) == hash(kernels.KernelConfig(backend="gemm=pallas", partitioning="always"))
  with pytest.raises(ValueError, match="kernels.backend: unknown kernel backend 'fast'"):
    kernels.KernelConfig(backend="fast")
  with pytest.raises(ValueError, match="kernels.partitioning must be one of"):
    kernels.KernelConfig(partitioning="never")
  with pytest.raises(TypeError, match="KernelConfig"):
    with kernels.use("reference"):
      pass
  with kernels.backend("pallas"), kernels.partitioning("always"):   # None: keeps the context's
    with kernels.use(kernels.KernelConfig()):
      assert set(kernels.current_backend().values()) == {"pallas"}
      assert kernels.current_partitioning() == "always"
    with kernels.use(kernels.KernelConfig(backend="quantize=reference")):
      assert kernels.current_backend()["quantize"] == "reference"
      assert kernels.current_backend()["gemm"] == "auto"
      assert kernels.current_partitioning() == "always"


def test_the_environment_overrides_the_backend_with_a_one_line_error(monkeypatch):
  monkeypatch.setenv(kernels.ENV, "quantize=reference")
  with kernels.backend("pallas"):
    assert kernels.current_backend()["quantize"] == "reference"
    assert kernels.current_backend()["gemm"] == "auto"
  monkeypatch.setenv(kernels.ENV, "turbo")
  with pytest.raises(ValueError) as e:
    kernels.implementation("gemm")
  assert str(e.value).startswith("COAT_JAX_KERNELS: unknown kernel backend 'turbo'")
  assert "\n" not in str(e.value)


def test_a_bad_environment_value_does_not_break_the_import():
  """Read when a family is first asked, not at import: importing the library never fails on it."""
  env = {"COAT_JAX_KERNELS": "turbo", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  code = "import coat_jax.kernels, coat_jax.training.build; print('imported')"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-2000:]


def test_adam_triton_without_triton_names_the_install():
  if backends.triton_available():
    pytest.skip("triton and jax-triton are installed here")
  shape = (4, 128)
  p = jnp.ones(shape)
  m = expansion.quantize_expanded(jnp.full(shape, 1e-3), "e4m3", 128, 16)
  with kernels.backend("adam=triton"), pytest.raises(ValueError, match=r"coat-jax\[gpu\]"):
    kernels_adam.coat_adam_step(p, p, m, m, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0,
                                count=jnp.int32(1), m_format="e4m3", v_format="e4m3",
                                group_size=128, expand=True, expand_min=16)


@pytest.mark.parametrize("shape,dtype,g", [((64, 64), jnp.bfloat16, 16),
                                           ((2, 16, 256), jnp.float32, 128)])
def test_mosaic_quantize_equals_the_reference(rng, shape, dtype, g):
  x = _inputs(rng, shape, dtype)
  group = jax.jit(lambda a: kernels.quantize_per_group(a, g, "e4m3"))
  tensor = jax.jit(lambda a: kernels.quantize_per_tensor(a, "e5m2", with_transpose=True))
  with kernels.backend("pallas"):
    assert _uses_kernel(group, x)
    assert _uses_kernel(tensor, x) == (jnp.dtype(dtype).itemsize == 2)   # f32: no transpose
    qg, qt = group(x), tensor(x)
    deq = kernels.dequantize(qg, jnp.float32)
  _assert_same(qg, ref_per_group(x, g, "e4m3"))
  _assert_same(qt, ref_per_tensor(x, "e5m2", with_transpose=True))
  _assert_same(deq, ref_dequantize(qg, jnp.float32))


def test_dequantize_for_a_consumer_fusion_is_xla_and_equal(rng):
  """consumer_fusion=True: XLA's ops (no kernel) where the mosaic kernel would run; same values."""
  x = _inputs(rng, (64, 256), jnp.bfloat16)
  with kernels.backend("pallas"):
    qg = kernels.quantize_per_group(x, 16, "e4m3")
    kernel = jax.jit(lambda q: kernels.dequantize(q, jnp.float32))
    fused = jax.jit(lambda q: kernels.dequantize(q, jnp.float32, consumer_fusion=True))
    assert _uses_kernel(kernel, qg) and not _uses_kernel(fused, qg)
    _assert_same(fused(qg), kernel(qg))


def test_per_tensor_given_amax_and_plain(rng):
  x = _inputs(rng, (64, 128), jnp.float32)
  amax = jnp.float32(3.0)
  with kernels.backend("quantize=mosaic"):
    plain = jax.jit(lambda a: kernels.quantize_per_tensor(a, "e4m3"))
    assert _uses_kernel(plain, x)
    _assert_same(plain(x), ref_per_tensor(x, "e4m3"))
    _assert_same(jax.jit(lambda a, m: kernels.quantize_per_tensor(a, amax=m))(x, amax),
                 jax.jit(lambda a, m: quantize.quantize_per_tensor(a, amax=m))(x, amax))


@pytest.mark.parametrize("backend", ["quantize=mosaic", "reference"])
@pytest.mark.parametrize("amax_given", [True, False])
def test_per_tensor_of_a_cast_equals_the_cast_quantized(rng, backend, amax_given):
  """cast_dtype: a float32 x quantized as x.astype(bfloat16), with the transposed copy, its amax
  max|x| (given unrounded, or found): the kernel (which reads x and rounds it as it loads) and the
  reference (which casts first) both equal the reference of the cast, bit for bit."""
  x = _inputs(rng, (128, 192), jnp.float32)
  xb = x.astype(jnp.bfloat16)
  amax = jnp.max(jnp.abs(x))
  assert amax != jnp.max(jnp.abs(xb)).astype(jnp.float32)   # the rounding is there to be seen
  fn = jax.jit(lambda a, m: kernels.quantize_per_tensor(
      a, "e4m3", amax=m if amax_given else None, with_transpose=True, cast_dtype=jnp.bfloat16))
  with kernels.backend(backend):
    assert _uses_kernel(fn, x, amax) == (backend != "reference")
    got = fn(x, amax)
  want = jax.jit(lambda a: quantize.quantize_per_tensor(a, "e4m3", with_transpose=True))(xb)
  _assert_same(got, want)
  assert not np.array_equal(_bits(got.data), _bits(ref_per_tensor(x, "e4m3").data))


@pytest.mark.parametrize("shape,g,transpose", [
    ((4, 48), 16, False),     # 12 groups (not a multiple of 64) and N % 64 != 0
    ((32, 64), 16, True),     # 128 groups, but M = 32: no transposed kernel
    ((64, 40), 8, False)])    # G < 16
def test_shapes_the_kernels_do_not_take_go_to_the_reference(rng, shape, g, transpose):
  x = _inputs(rng, shape, jnp.float32)
  group = jax.jit(lambda a: kernels.quantize_per_group(a, g, "e4m3"))
  tensor = jax.jit(lambda a: kernels.quantize_per_tensor(a, "e4m3", with_transpose=transpose))
  with kernels.backend("pallas"):
    assert _uses_kernel(group, x) == (shape == (32, 64))   # 128 groups of 16: the kernel
    assert not _uses_kernel(tensor, x)
    _assert_same(group(x), ref_per_group(x, g, "e4m3"))
    _assert_same(tensor(x), ref_per_tensor(x, "e4m3", with_transpose=transpose))


def test_backend_context_keys_jit_cache(rng):
  """The same jitted function traces once per backend, in one process."""
  x = _inputs(rng, (64, 32), jnp.float32)
  traces = []

  @jax.jit
  def f(a):
    traces.append(kernels.current_backend()["quantize"])
    return kernels.quantize_per_group(a, 16).data

  with kernels.backend("pallas"):
    assert _uses_kernel(f, x)
  with kernels.backend("reference"):
    assert not _uses_kernel(f, x)
  with kernels.backend("quantize=mosaic"):
    f(x)
  assert traces == ["pallas", "reference", "mosaic"]
  g_traces = []

  @jax.jit
  def g(a):
    g_traces.append(kernels.current_backend()["quantize"])
    return kernels.quantize_per_group(a, 16).data

  # a KernelConfig, as the run config's `kernels:` section gives it, keys the cache too
  for spec in ("reference", "pallas", "pallas"):
    with kernels.use(kernels.KernelConfig(backend=spec)):
      g(x)
  assert g_traces == ["reference", "pallas"]

"""pallas_kernels/compile_ahead/compile_triton.py on the CPU: a Triton call's compile found by a dry lowering at
trace time, run in a worker process, and handed to the real lowering; its failures fall back to
compiling in the lowering.

jax-triton cannot import here, so a stand-in primitive plays jax-triton's call: its CUDA lowering
asks `compile_triton.get_or_create` for its kernel exactly as jax-triton's rule asks
`get_or_create_triton_kernel`, and the worker runs `_worker_compile` below instead of Triton. The
real kernels through the real jax-triton are in tests/test_kernels_adam_triton.py (GPU).
"""
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pallas_kernels.compile_ahead import compile_triton as ct

SEED = 11
METAPARAMS = {"BLOCK": 16, "FAST": True}


class _JitFunction:  # as @triton.jit: the module attribute wraps the function of the same name
  def __init__(self, fn):
    self.fn = fn
    self.__name__ = fn.__name__


def step_kernel():  # noqa: D103 - the stand-in kernel
  pass


step_kernel = _JitFunction(step_kernel)
local_kernel = _JitFunction(lambda: None)   # not importable by name: compiles inline


def _worker_compile(kernel, platform, arg_dtypes, scalar_args, kw):
  """What the worker runs here instead of Triton: the 'kernel' names its maker's process."""
  if kw["metaparams"].get("BLOCK") == 13:
    raise ValueError("BLOCK must be a power of two")
  return {"kernel_args": (f"{kernel['name']}:{'|'.join(arg_dtypes)}", os.getpid()),
          "attrs": {(0,): [["tt.divisibility", 16]]}}


def _inline(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
  _inline.calls += 1
  return (f"{fn.__name__}:inline", os.getpid()), {}


_primitive = Primitive("fake_triton_call")
_primitive.def_abstract_eval(lambda x, **_: jax.core.ShapedArray(x.shape, x.dtype))


def _lowering(ctx, x, *, fn, size, block):
  kernel, _ = ct.get_or_create(
      _inline, None, ctx.module_context.platforms[0], fn,
      ["*" + str(ctx.avals_in[0].dtype), "i32", "*" + str(ctx.avals_out[0].dtype)],
      ((1, "i32", size),), num_warps=4, num_stages=1, num_ctas=1, compute_capability=90,
      enable_fp_fusion=True, metaparams=dict(METAPARAMS, BLOCK=block), dump=False)
  return jax.ffi.ffi_lowering("fake_kernel", api_version=2,
                              backend_config=f"{kernel[0]}@{kernel[1]}")(ctx, x)


mlir.register_lowering(_primitive, _lowering, platform="cuda")


def _call(x, size, *, kernel, out_shape, block=16):
  """The stand-in for jax_triton.triton_call (operands: one array, one Python int)."""
  del out_shape
  return _primitive.bind(x, fn=kernel, size=size, block=block)


def _traced_call(x, size, kernel=step_kernel, block=16):
  kwargs = dict(out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), block=block)
  ct.start(_call, kernel, (x, size), kwargs)
  return _call(x, size, kernel=kernel, **kwargs)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
  monkeypatch.setattr(ct, "WORKER_CALL", (__name__, "_worker_compile"))
  monkeypatch.setattr(ct, "_build", lambda r: (tuple(r["kernel_args"]), r["attrs"]))
  monkeypatch.setattr(ct, "MODE", "process")
  monkeypatch.setattr(ct, "POOL", "test-triton")   # one process: the reuse test sees its pid
  monkeypatch.setattr(ct, "POOL_SIZE", 1)
  for d in (ct._traced, ct._jobs, ct._built):
    d.clear()
  monkeypatch.setattr(ct, "stats", dict.fromkeys(ct.stats, 0))
  _inline.calls = 0
  yield


def _configs(hlo: str) -> list[str]:
  return [l.split('backend_config = "')[1].split('"')[0] for l in hlo.splitlines()
          if "fake_kernel" in l]


def _x(shape, dtype=jnp.float32):
  rng = np.random.default_rng(SEED)
  return jnp.asarray(rng.standard_normal(shape), dtype)


def test_compile_runs_in_a_worker_process_once_per_distinct_kernel():
  def step(a, b, c):   # two leaves of one dtype, sizes apart; one of another dtype
    return (_traced_call(a, a.size // 128), _traced_call(b, b.size // 128),
            _traced_call(c, c.size // 128))

  args = (_x((256, 128)), _x((1024, 128)), _x((128, 128), jnp.bfloat16))
  traced = jax.jit(step).trace(*args)
  assert ct.stats["started"] == 2          # float32 and bfloat16 kernels; the size is not in it
  hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert ct.stats["from_worker"] == 2 and _inline.calls == 0
  configs = _configs(hlo)
  assert len(configs) == 3
  names, pids = zip(*(c.split("@") for c in configs))
  assert names == ("step_kernel:*float32|i32|*float32",) * 2 + ("step_kernel:*bfloat16|i32|*bfloat16",)
  assert all(int(p) != os.getpid() for p in pids)      # built in another process


def test_a_second_lowering_reuses_the_kernel_and_the_worker_process_is_kept():
  step = lambda a: _traced_call(a, a.size // 128)
  first = _configs(jax.jit(step).trace(_x((256, 128))).lower(lowering_platforms=("cuda",)).as_text())
  again = _configs(jax.jit(step).trace(_x((512, 128))).lower(lowering_platforms=("cuda",)).as_text())
  assert first == again and ct.stats["started"] == 1 and ct.stats["from_worker"] == 1
  ct._built.clear()
  ct._traced.clear()     # a new compile: the same pool thread's process answers
  step16 = lambda a: _traced_call(a, a.size // 128, block=32)
  other = _configs(jax.jit(step16).trace(_x((256, 128))).lower(lowering_platforms=("cuda",)).as_text())
  assert ct.stats["started"] == 2
  assert other[0].split("@")[1] == first[0].split("@")[1]


def test_a_failed_worker_compile_is_compiled_in_the_lowering_with_a_warning():
  step = lambda a: _traced_call(a, a.size // 128, block=13)
  traced = jax.jit(step).trace(_x((256, 128)))
  assert ct.stats["started"] == 1
  with pytest.warns(RuntimeWarning, match="BLOCK must be a power of two.*compiling step_kernel"):
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert _configs(hlo) == [f"step_kernel:inline@{os.getpid()}"]
  assert ct.stats["worker_failed"] == 1 and _inline.calls == 1


def test_inline_mode_and_unimportable_kernels_compile_in_the_lowering(monkeypatch):
  step = lambda a: _traced_call(a, a.size // 128, kernel=local_kernel)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    hlo = jax.jit(step).trace(_x((256, 128))).lower(lowering_platforms=("cuda",)).as_text()
  assert ct.stats["started"] == 0 and _inline.calls == 1 and len(_configs(hlo)) == 1
  monkeypatch.setattr(ct, "MODE", "inline")
  step = lambda a: _traced_call(a, a.size // 128)
  jax.jit(step).trace(_x((256, 128))).lower(lowering_platforms=("cuda",))
  assert ct.stats["started"] == 0 and _inline.calls == 2
  monkeypatch.setattr(ct, "MODE", "threads")
  with pytest.raises(ValueError, match="MODE must be one of.*'threads'"):
    jax.jit(lambda a: _traced_call(a, 2)).trace(_x((256, 128)))


def test_the_compile_key_keeps_what_the_compile_depends_on_only():
  kw = dict(num_warps=4, num_stages=1, metaparams=dict(BLOCK=16))
  key = lambda scalars, **over: ct.compile_key(step_kernel, ["*fp32", "i32"], scalars, {**kw, **over})
  assert key(((1, "i32", 4096),)) == key(((1, "i32", 8192),))    # a runtime size
  assert key(((1, "i32", 4096),)) != key(((1, "i32", 1),))       # 1 is a constant to Triton
  assert key(((1, "i32", 4096),)) != key(((1, "i32", 4096),), num_warps=8)
  assert key(((1, "i32", 4096),)) != key(((1, "i32", 4096),), metaparams=dict(BLOCK=32))
  assert ct.trace_key(step_kernel, (_x((8, 128)), 5), {}) == ct.trace_key(
      step_kernel, (_x((16, 128)), 7), {})
  assert ct.trace_key(step_kernel, (_x((8, 128)), 5), {}) != ct.trace_key(
      step_kernel, (_x((8, 128)), 2**40), {})                    # i32 vs i64

"""The project's Triton kernels in Triton's interpreter, on CPU: the same @triton.jit source the GPU
compiles, run on numpy buffers (no torch).

`launch(kernel, grid, *args, **constexprs)` runs a @triton.jit kernel the way
TRITON_INTERPRET=1 would (an `InterpretedFunction` of its Python function; the @triton.jit
functions it calls, the project's and triton.language's own, interpreted as they are called),
with numpy arrays as its buffers (`HostTensor`: the pointer and dtype the interpreter reads, no
copies), and, while it runs, what the interpreter cannot run or runs otherwise than the GPU
mapped to what the GPU does: libdevice's exp2 / log2 (stubs there) and `_approx`'s MUFU
instructions (inline PTX) to numpy's float32 math, and the float conversions to the GPU's
(`gpu_float_casts`: triton 3.6's interpreter truncates float32 -> bfloat16, rounds FP8 ties
away from zero and drops the mantissa carry, 128 -> 64; the GPU's cvt instructions round to
nearest even, and FP8 ones saturate, `cvt.rn.satfinite`). Nothing is changed outside `launch`:
the same process compiles the same kernels for the GPU as usual.
"""
from __future__ import annotations

import contextlib
import importlib
import os

import ml_dtypes
import numpy as np

try:
  import triton
  import triton.language as tl
  from triton.language import core  # noqa: F401 (`_lang_anchor`'s globals)
  from triton.runtime import interpreter as _interp
except ImportError:  # CI installs triton (the test extra); tests/test_kernels_adam_triton.py says
  triton = tl = core = _interp = None

TILE = "pallas_kernels.adam.adam_tile_triton"
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_triton():
  """Skips the calling test where triton is not installed; fails it in CI, which installs triton
  (the test extra) so that the GPU's Triton kernels always run there."""
  import pytest
  if triton is None:
    if IN_CI:
      pytest.fail("triton is not installed, so CI would skip the Triton kernels: install the "
                  "test extra (pip install -e .[test])")
    pytest.skip("triton is not installed (CI installs it)")


class HostTensor:
  """A numpy array as the torch-like tensor Triton's interpreter takes (same memory)."""

  class _Storage:
    def __init__(self, arr):
      self.arr = arr

    def data_ptr(self):
      return self.arr.ctypes.data

    def cpu(self):
      return self

    def copy_(self, other):   # "device" and host copies are the same memory
      pass

  class _Dtype:
    def __init__(self, name):
      self.name = name

    def __str__(self):   # Triton reads pointer types from torch's dtype names
      return "torch." + self.name

  _dtypes: dict = {}   # one dtype object per name for the process: triton's argument
                       # specialization caches by the dtype object, so it must never be freed
                       # (a new one at a freed one's address would read as its dtype)

  def __init__(self, arr: np.ndarray):
    if not arr.flags.c_contiguous:
      raise ValueError("HostTensor: the kernels take C-contiguous buffers")
    name = str(arr.dtype)
    self.arr, self.dtype = arr, self._dtypes.setdefault(name, self._Dtype(name))

  def data_ptr(self):
    return self.arr.ctypes.data

  def untyped_storage(self):
    return self._Storage(self.arr)

  def new_empty(self, *args, **kwargs):
    return HostTensor(self.arr)

  def set_(self, *args):
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.arr.shape

  def stride(self):
    return tuple(s // self.arr.itemsize for s in self.arr.strides)


def _approx(x, ptx):
  """`_approx`'s MUFU instructions as numpy float32 math (the interpreter runs no PTX)."""
  op = ptx.split(".")[0]
  if op == "lg2":
    return tl.math.log2(x)
  if op == "ex2":
    return tl.math.exp2(x)
  if op == "sqrt":
    return tl.math.sqrt(x)
  if op == "rcp":
    return 1.0 / x
  raise NotImplementedError(ptx)


class _Libdevice:
  """libdevice's exp2 / log2 as tl.math's (the interpreter leaves libdevice's stubs empty)."""

  @staticmethod
  def exp2(x):
    return tl.math.exp2(x)

  @staticmethod
  def log2(x):
    return tl.math.log2(x)


_FLOATS = None


def _floats():
  global _FLOATS
  if _FLOATS is None:
    _FLOATS = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2,
               tl.bfloat16: ml_dtypes.bfloat16, tl.float16: np.float16,
               tl.float32: np.float32, tl.float64: np.float64}
  return _FLOATS


def _convert(data, src, dst):
  """float src -> float dst values as the GPU converts them: round to nearest even, FP8
  saturating to its largest finite value (NaN kept)."""
  fl = _floats()
  x = data.view(fl[src]) if data.dtype.kind == "u" else data   # FP8 / bfloat16 stored as uint
  x = x.astype(np.float64 if src == tl.float64 else np.float32)
  out_t = fl[dst]
  if dst in (tl.float8e4nv, tl.float8e5):
    big = float(ml_dtypes.finfo(out_t).max)
    x = np.where(np.isnan(x), x, np.clip(x, -big, big))
  y = x.astype(out_t)
  return y.view(_interp._get_np_dtype(dst))


@contextlib.contextmanager
def gpu_float_casts():
  """The interpreter's float -> float conversions made the GPU's (`_convert`), while inside."""
  b = _interp.interpreter_builder
  old_cast, old_fp = b.cast_impl, b.create_fp_to_fp
  fl = _floats()

  def cast_impl(src, dst_type):
    s, d = src.dtype.scalar, dst_type.scalar
    if s in fl and d in fl:
      return _interp.TensorHandle(_convert(src.data, s, d), d)
    return old_cast(src, dst_type)

  def create_fp_to_fp(src, dst_type, rounding_mode):
    if rounding_mode not in (None, _interp._ir.ROUNDING_MODE.RTNE):
      raise NotImplementedError(f"rounding mode {rounding_mode}")
    return cast_impl(src, dst_type)

  b.cast_impl, b.create_fp_to_fp = cast_impl, create_fp_to_fp
  try:
    yield
  finally:
    b.cast_impl, b.create_fp_to_fp = old_cast, old_fp


def _lang_anchor():
  """A function whose globals hold triton.language and its core: `_patch_lang` of it patches
  both (the project's kernels see `tl`, triton.language's own @jit functions `core`)."""


@contextlib.contextmanager
def _interpreting(tile_module):
  """While inside: triton.language (and its core) patched for the interpreter once, restored at
  the end; @triton.jit functions called from a kernel run as interpreted functions without
  patching it again (InterpretedFunction.__call__ patches the language each call and never
  restores it, which would leave it patched for the GPU compiles of the same process); the
  kernel module's libdevice and `_approx` as numpy math."""
  from triton.runtime.jit import JITFunction
  cache = {}

  def call(self, *args, **kwargs):
    if self.fn not in cache:
      cache[self.fn] = _interp.InterpretedFunction(self.fn).rewrite()
    return cache[self.fn](*args, **kwargs)

  old = JITFunction.__call__, tile_module.libdevice, tile_module._approx
  scope = _interp._patch_lang(_lang_anchor)
  JITFunction.__call__, tile_module.libdevice, tile_module._approx = call, _Libdevice, _approx
  try:
    yield
  finally:
    JITFunction.__call__, tile_module.libdevice, tile_module._approx = old
    scope.restore()


GUARD = 4096   # bytes of sentinel on each side of every buffer `launch` passes


def _guarded(a: np.ndarray):
  """(a copy of a inside a byte buffer with GUARD sentinel bytes on each side, the buffer)."""
  raw = np.full(a.nbytes + 2 * GUARD, 0xA5, np.uint8)
  inner = raw[GUARD:GUARD + a.nbytes].view(a.dtype).reshape(a.shape)
  inner[...] = a
  return inner, raw


def launch(kernel, grid: int, *args, **constexprs):
  """kernel[(grid,)](*args, **constexprs) in Triton's interpreter, numpy arrays as the buffers
  (the results written into them; arrays passed twice are one buffer, as aliased operands are).
  Each buffer runs inside sentinel bytes: AssertionError if the kernel wrote outside one."""
  if triton is None:
    raise ImportError("triton is not installed")
  tile = importlib.import_module(TILE)
  copies = {}
  for a in args:
    if isinstance(a, np.ndarray) and id(a) not in copies:
      copies[id(a)] = (a, *_guarded(np.ascontiguousarray(a)))
  wrapped = [HostTensor(copies[id(a)][1]) if isinstance(a, np.ndarray) else a for a in args]
  with _interpreting(tile), gpu_float_casts(), np.errstate(all="ignore"):  # log2(0) = -inf
    _interp.InterpretedFunction(kernel.fn)[(grid,)](*wrapped, **constexprs)
  for a, inner, raw in copies.values():
    outside = np.concatenate([raw[:GUARD], raw[GUARD + a.nbytes:]])
    assert np.all(outside == 0xA5), f"the kernel wrote outside a {a.dtype} {a.shape} buffer"
    a[...] = inner

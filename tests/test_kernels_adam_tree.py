"""The optimizer step over a whole tree (pallas_kernels/adam_tree_triton.py, kernels.
coat_adam_tree_step): the launch plan and the generated kernel's program-id -> leaf mapping on CPU
(the kernel source run as plain Python with a recording stand-in for the row step), the dispatch's
fallback on CPU, and on the GPU the kernel against the float64 numpy reference."""
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax import adam_math, expansion, kernels, kernels_adam, optim
from pallas_kernels import adam_tree_triton as tk
from tests.test_kernels_adam import _compare as compare_steps, n_kernels
from tests.test_kernels_adam_mgpu import EM, G, HYPER, _code_steps, _log2_range, _np_quantize, \
    _np_step, _state


def test_plan_prefix_sums_and_launch_split():
  rows = [4096] * 56 + [4096] * 6 + [5, 17]
  launches = tk.plan(rows, block=16)
  assert tk.MAX_LEAVES * 8 * tk.POINTERS_PER_LEAF + tk.RESERVED_BYTES <= tk.PARAM_BYTES
  assert [len(l.leaves) for l in launches] == [32, 32]     # 64 leaves, <= 33 each, even split
  assert sorted(i for l in launches for i in l.leaves) == list(range(len(rows)))
  last = launches[-1]
  assert last.rows[-2:] == (5, 17) and last.starts[-3:] == (30 * 256, 30 * 256 + 1,
                                                            30 * 256 + 1 + 2)
  for l in launches:
    assert l.starts[0] == 0 and len(l.starts) == len(l.leaves) + 1
    assert np.all(np.diff(l.starts) == [math.ceil(r / 16) for r in l.rows])


def test_plan_groups_by_key_and_rejects_bad_input():
  launches = tk.plan([3, 4, 5, 6, 7], block=2, max_leaves=2, keys=["a", "b", "a", "a", "b"])
  assert [l.leaves for l in launches] == [(0, 2), (3,), (1, 4)]
  assert launches[0].starts == (0, 2, 5)
  with pytest.raises(ValueError, match=">= 1 row"):
    tk.plan([4, 0], block=16)
  with pytest.raises(ValueError, match="max_leaves"):
    tk.plan([4], block=16, max_leaves=0)


class _Int(int):
  """A Python int standing in for Triton's scalar int32 (program id and what derives from it)."""

  def __mul__(self, o):
    return _Int(int(self) * int(o))

  def __add__(self, o):
    return _Int(int(self) + int(o))

  def __sub__(self, o):
    return _Int(int(self) - int(o))

  def to(self, dtype):
    return float(self)


class _FakeTL:
  float32, constexpr = "f32", "constexpr"

  def __init__(self, pid):
    self.pid = pid

  def program_id(self, axis):
    return _Int(self.pid)

  @staticmethod
  def load(ptr):
    assert ptr == "s_ptr + 6"
    return 0.5


class _Ptr(str):
  def __add__(self, o):
    return f"{self} + {o}"


@pytest.mark.parametrize("rows,decay", [((3, 40, 1, 17), (True, False, True, False)),
                                        ((9,), (False,))])
def test_generated_kernel_maps_every_row_block_to_its_leaf_once(rows, decay):
  """The kernel source of `plan`'s table, executed as Python per program id: each program runs
  the row step once, on its leaf's 15 pointers, with that leaf's row count and weight decay."""
  block = 8
  [launch] = tk.plan(rows, block)
  src = tk._kernel_source(launch.rows, launch.starts, decay)
  calls = []
  n = len(rows)
  args = ([_Ptr("s_ptr")] + [f"{a}{j}" for j in range(n) for a in tk._IN]
          + [f"{a}{j}" for j in range(n) for a in tk._OUT] + list(tk._STATIC))
  for pid in range(launch.starts[-1]):
    scope = {"tl": _FakeTL(pid), "adam_rows": lambda *a: calls.append((pid, a))}
    exec(src, scope)
    scope["adam_tree_kernel"](*args)
  assert len(calls) == launch.starts[-1]
  seen = set()
  for pid, (blk, n_rows, wd, s, *rest) in calls:
    ptrs, statics = rest[:15], rest[15:]
    leaf = int(ptrs[0][1:])
    assert list(ptrs) == [f"{a}{leaf}" for a in tk._IN + tk._OUT] and s == "s_ptr"
    assert list(statics) == list(tk._STATIC)
    assert n_rows == rows[leaf] and wd == (0.5 if decay[leaf] else 0.0)
    assert 0 <= blk * block < rows[leaf]
    seen.add((leaf, int(blk)))
  assert seen == {(j, b) for j in range(n) for b in range(math.ceil(rows[j] / block))}


def _tree_inputs(rng, shapes, fmt="e4m3"):
  ps, gs, ms, vs = [], [], [], []
  for s in shapes:
    p = jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal(s) * np.exp2(rng.integers(-8, 2, s)), jnp.float32)
    m0 = jnp.asarray(rng.standard_normal(s) * 1e-3, jnp.float32)
    v0 = jnp.asarray(np.abs(rng.standard_normal(s)) * 1e-6, jnp.float32)
    ps.append(p)
    gs.append(g)
    if len(s) == 1:   # a small leaf: float32 moments
      ms.append(m0)
      vs.append(v0)
    else:
      ms.append(expansion.quantize_expanded(m0, fmt, G, EM, True))
      vs.append(expansion.quantize_expanded(v0, fmt, G, EM, True))
  return ps, gs, ms, vs


STEP = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, m_format="e4m3",
            v_format="e4m3", group_size=G, expand=True, expand_min=EM)


def test_dispatch_without_tree_kernel_is_the_per_leaf_reference(rng):
  """On CPU (no triton) every leaf takes the reference, with weight decay only where flagged."""
  ps, gs, ms, vs = _tree_inputs(rng, [(2, 256), (3, 128), (7,)])
  decay = [True, False, False]
  count = jnp.int32(2)
  assert kernels_adam._tree_kernel_leaves(ps, gs, ms, vs, G) == []

  def both(ps, gs, ms, vs):
    got = kernels_adam.coat_adam_tree_step(ps[:3], gs[:3], ms[:3], vs[:3], decay, count=count,
                                      **STEP)
    wants = [adam_math.adam_step_reference(
        p, g, m, v, count=count, **dict(STEP, weight_decay=STEP["weight_decay"] * d))
        for p, g, m, v, d in zip(ps, gs, ms, vs, decay + [True])]
    return got, wants   # wants[-1]: leaf 1 with decay, which the dispatch must not apply

  got, wants = jax.jit(both)(ps + [ps[1]], gs + [gs[1]], ms + [ms[1]], vs + [vs[1]])
  for i, want in enumerate(wants[:3]):
    # XLA may fuse (and round) the two computations differently, by an ulp.
    np.testing.assert_allclose(np.asarray(got[i][0]), np.asarray(want[0]), rtol=2e-6)
    for a, b in zip(got[i][1:], want[1:]):
      if isinstance(b, expansion.ExpandedMoment):
        np.testing.assert_array_equal(np.asarray(a.k_code), np.asarray(b.k_code))
        np.testing.assert_allclose(np.asarray(a.amax), np.asarray(b.amax), rtol=2e-6)
        steps = _code_steps(np.asarray(a.data), np.asarray(b.data))
        assert steps.max() <= 1 and steps.mean() < 0.01
      else:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)
  assert not np.allclose(np.asarray(got[1][0]), np.asarray(wants[3][0]), rtol=1e-7, atol=0)
  with pytest.raises(ValueError, match="lengths must agree"):
    kernels_adam.coat_adam_tree_step(ps, gs, ms, vs, decay[:2], count=count, **STEP)


def test_tree_step_operands_aliases_and_results(monkeypatch):
  """tree_step's wiring, with the launch recorded instead of run (no GPU here): leaves split into
  launches by dtype and max_leaves, each leaf's 8 operands in the kernel's order, param and
  moments aliased to their outputs, the grid = the table's last prefix sum, and each leaf given
  back its own 7 outputs."""
  calls = []

  class FakeJT:
    @staticmethod
    def triton_call(*operands, kernel, out_shape, grid, input_output_aliases, **meta):
      calls.append(dict(operands=operands, kernel=kernel, grid=grid,
                        aliases=input_output_aliases, meta=meta))
      return [jnp.full(o.shape, 10 * len(calls) + k, o.dtype) for k, o in enumerate(out_shape)]

  monkeypatch.setattr(tk, "available", lambda: True)
  monkeypatch.setattr(tk, "_kernel", lambda rows, starts, decay: (rows, starts, decay))
  monkeypatch.setattr(tk.call_triton, "triton_call", FakeJT.triton_call)
  f8, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  shapes = [(4, 128), (3, 256), (40, 128)]
  grad_dtypes = [jnp.float32, jnp.bfloat16, jnp.float32]
  ps = [jnp.zeros(s, jnp.float32) for s in shapes]
  gs = [jnp.ones(s, d) for s, d in zip(shapes, grad_dtypes)]
  meta = lambda s: s[:-1] + (s[-1] // G,)
  ms = [(jnp.zeros(s, f8), jnp.ones(meta(s)), jnp.ones(meta(s), jnp.uint8)) for s in shapes]
  vs = [(jnp.zeros(s, e5), jnp.ones(meta(s)), jnp.ones(meta(s), jnp.uint8)) for s in shapes]
  out = tk.tree_step(ps, gs, ms, vs, [True, True, False], count=jnp.int32(1), m_fmax=448.0,
                     v_fmax=57344.0, m_log2_range=16.6, v_log2_range=30.0, group_size=G,
                     expand=True, expand_min=EM, block=16, **HYPER)
  assert len(calls) == 2                       # the bf16-gradient leaf gets its own launch
  first, second = calls
  assert first["kernel"] == ((4, 40), (0, 1, 4), (True, False)) and first["grid"] == (4,)
  assert second["kernel"] == ((6,), (0, 1), (True,)) and second["grid"] == (1,)
  ops = first["operands"]
  assert ops[1] is ps[0] and ops[2] is gs[0] and ops[3:9] == (*ms[0], *vs[0])
  assert ops[9] is ps[2] and ops[10] is gs[2]
  assert first["aliases"] == {1: 0, 3: 1, 4: 2, 5: 3, 6: 4, 7: 5, 8: 6,
                              9: 7, 11: 8, 12: 9, 13: 10, 14: 11, 15: 12, 16: 13}
  assert first["meta"]["HAS_PARAM"] and first["meta"]["M_FMAX"] == 448.0
  for i, launch_no, j in ((0, 1, 0), (2, 1, 1), (1, 2, 0)):
    o, m3, v3 = out[i]
    got = [o, *m3, *v3]
    want = [jnp.asarray(10 * launch_no + 7 * j + k, a.dtype) for k, a in enumerate(got)]
    assert all(np.asarray(a.ravel()[0], np.float32) == np.asarray(w, np.float32)
               for a, w in zip(got, want))
    assert got[0].shape == shapes[i] and got[2].shape == meta(shapes[i])
    assert got[1].dtype == f8 and got[4].dtype == e5 and got[3].dtype == jnp.uint8


def test_dispatch_hands_quantized_leaves_to_the_tree_kernel(rng, monkeypatch):
  """Where the tree kernel is in use (faked here: it returns the reference's step), the dispatch
  gives it the quantized leaves with the formats' limits, and wraps its moments back."""
  ps, gs, ms, vs = _tree_inputs(rng, [(2, 256), (7,), (1, 128)])
  vs = [expansion.quantize_expanded(expansion.dequantize_expanded(v, "e4m3", G, EM), "e5m2", G,
                                    EM, True) if i != 1 else v for i, v in enumerate(vs)]
  step = dict(STEP, v_format="e5m2")
  seen = {}

  def fake_tree_step(params, grads, m_states, v_states, decay, **kw):
    seen.update(kw, n=len(grads), decay=decay)
    outs = []
    for p, g, m, v, d in zip(params, grads, m_states, v_states, decay):
      o, m2, v2 = adam_math.adam_step_reference(
          p, g, expansion.ExpandedMoment(*m), expansion.ExpandedMoment(*v), count=kw["count"],
          **dict(step, weight_decay=kw["weight_decay"] * d))
      outs.append((o, tuple(m2), tuple(v2)))
    return outs

  monkeypatch.setattr(kernels_adam, "_tree_kernel_leaves", lambda *a: [0, 2])
  monkeypatch.setattr(tk, "tree_step", fake_tree_step)
  got = kernels_adam.coat_adam_tree_step(ps, gs, ms, vs, [True, True, False], count=jnp.int32(1),
                                    **step)
  assert seen["n"] == 2 and seen["decay"] == [True, False]
  assert (seen["m_fmax"], seen["v_fmax"], seen["max_k_code"]) == (448.0, 57344.0,
                                                                   expansion.MAX_K_CODE)
  assert seen["grad_clamp"] == adam_math.GRAD_CLAMP and seen["fast_math"] and seen["alias"]
  assert seen["v_log2_range"] > seen["m_log2_range"] > 0
  for i in range(3):
    want = adam_math.adam_step_reference(ps[i], gs[i], ms[i], vs[i], count=jnp.int32(1), **dict(
        step, weight_decay=step["weight_decay"] * (i < 2)))
    assert type(got[i][1]) is type(want[1])
    for a, b in zip(jax.tree.leaves(got[i]), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-6)


def test_tree_step_refuses_clearly_without_jax_triton():
  if tk.available():
    pytest.skip("jax-triton is installed here")
  with pytest.raises(ValueError, match="not installed"):
    tk.tree_step([], [], [], [], [], count=jnp.int32(1), m_fmax=448.0, v_fmax=448.0,
                 m_log2_range=16.6, v_log2_range=16.6, group_size=G, expand=True,
                 expand_min=EM, **HYPER)


def test_kernel_compiles_for_hopper_without_a_gpu(tmp_path, monkeypatch):
  """Where triton is installed (no GPU needed): the generated 3-leaf kernel compiles for sm_90
  with every leaf's 15 pointers as parameters and the row step's vector loads."""
  triton = pytest.importorskip("triton")
  if tk.triton is None:
    pytest.skip("triton imported but not by the kernel module")
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))   # jax-triton's import empties it
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  [launch] = tk.plan((64, 300, 7), 16)
  fn = tk._kernel(launch.rows, launch.starts, (True, False, True))
  types = dict(p="*fp32", g="*bf16", mq="*fp8e4nv", ma="*fp32", mk="*u8", vq="*fp8e5",
               va="*fp32", vk="*u8", o="*fp32", mqo="*fp8e4nv", mao="*fp32", mko="*u8",
               vqo="*fp8e5", vao="*fp32", vko="*u8")
  sig = {n: "*fp32" if n == "s_ptr" else types.get(n.rstrip("0123456789"), "constexpr")
         for n in fn.arg_names}
  const = dict(G=G, BLOCK=16, HAS_PARAM=True, OUT_PARAM=True, M_FMAX=448.0, V_FMAX=57344.0,
               M_LOG2R=16.6, V_LOG2R=30.0, EXPAND=True, EM=16.0, MAX_K=255.0, FLOOR=1e-30,
               NOEXP_K=16.0, FAST=True, GCLAMP=2.0**63)
  attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
           if sig[n] != "constexpr"}
  k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=4, num_stages=1))
  ptx = k.asm["ptx"]
  assert ptx.count(".param .u64") >= 1 + 3 * tk.POINTERS_PER_LEAF
  assert "ld.global.v4.b32" in ptx and "lg2.approx.ftz.f32" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("output", ["param", "update"])
def test_gpu_tree_matches_float64_reference(output):
  """Five leaves of several shapes (one 3-D, one of 7 rows), decay on some, split into 3 launches
  (max_leaves=2): each leaf within one FP8 code of the float64 reference, amax and k as it."""
  shapes = [(300, 1024), (7, 128), (2, 40, 256), (129, 384), (16, 128)]
  decay = [True, False, True, True, False]
  refs, ins = [], []
  for i, shape in enumerate(shapes):
    p, g, m0, v0 = _state(shape, seed=41 + i)
    m_state, v_state = _np_quantize(m0, "e4m3", True)[:3], _np_quantize(v0, "e4m3", True)[:3]
    out, *_, mq, vq = _np_step(p.astype(np.float64), g.astype(np.float64), m_state, v_state, 3,
                               "e4m3", "e4m3", True, output)
    if not decay[i]:
      out = out + HYPER["lr"] * HYPER["weight_decay"] * p
    refs.append((p, out, mq, vq))
    ins.append((jnp.asarray(p), jnp.asarray(g), tuple(map(jnp.asarray, m_state)),
                tuple(map(jnp.asarray, v_state))))
  got = tk.tree_step([x[0] for x in ins], [x[1] for x in ins], [x[2] for x in ins],
                     [x[3] for x in ins], decay, count=jnp.int32(3), m_fmax=448.0,
                     v_fmax=448.0, m_log2_range=_log2_range(448.0),
                     v_log2_range=_log2_range(448.0), group_size=G, expand=True,
                     expand_min=EM, output=output, max_leaves=2, alias=False,
                     grad_clamp=2.0**63, **HYPER)
  for (p, out, (mq, ma, mk, _), (vq, va, vk, _)), (o, m3, v3) in zip(refs, got):
    o, m3, v3 = np.asarray(o), [np.asarray(a) for a in m3], [np.asarray(a) for a in v3]
    assert not np.isnan(o).any()
    base = out - (p if output == "param" else 0)
    rel = np.linalg.norm(o - (p if output == "param" else 0) - base) / np.linalg.norm(base)
    assert rel < 1e-4
    # Fast math (MUFU log2 / exp2, ~2^-22): tolerances of the Pallas kernel's fast-math test.
    for q, a, k, (gq, ga, gk) in ((mq, ma, mk, m3), (vq, va, vk, v3)):
      np.testing.assert_allclose(ga, a, rtol=5e-5)
      dk = np.abs(gk.astype(np.int32) - k.astype(np.int32))
      assert dk.max() <= 1 and np.mean(dk == 0) >= 0.95
      same_k = np.repeat(dk == 0, G, axis=-1).reshape(q.shape)
      steps = _code_steps(gq, q)[same_k]
      assert steps.max() <= 1 and np.mean(steps == 0) >= 0.99


@pytest.mark.gpu
def test_gpu_coat_adamw_apply_takes_one_launch_for_the_tree(rng, monkeypatch):
  """coat_adamw_apply on a 6-leaf tree (one leaf keeps float32 moments) compiles to one tree
  kernel launch and agrees with the per-leaf kernels (adam_tree=reference) within one code.
  One device's path (the tree kernel has no per-shard form), also on a host with several GPUs."""
  monkeypatch.setattr(kernels, "per_shard", lambda: False)
  shapes = {f"w{i}": (64 * (i + 1), 256) for i in range(5)} | {"bias": (7,)}
  params = {n: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for n, s in shapes.items()}
  grads = {n: jnp.asarray(rng.standard_normal(s) * 1e-3, jnp.float32) for n, s in shapes.items()}
  opt = optim.coat_adamw(1e-3, weight_decay=0.1)
  state = opt.init(params)
  apply = optim.coat_adamw_apply(1e-3, weight_decay=0.1)
  results = {}
  for backend in ("adam_tree=triton", "adam_tree=reference"):
    with kernels.backend(backend):
      traced = jax.jit(apply).trace(grads, state, params)
      results[backend] = (n_kernels(traced.jaxpr),
                          traced.lower().compile()(grads, state, params))
  # adam_tree=triton: one tree launch; adam_tree=reference: the per-leaf kernel per quantized leaf
  assert results["adam_tree=triton"][0] == 1
  assert results["adam_tree=reference"][0] == len(shapes) - 1
  (p1, s1), (p0, s0) = results["adam_tree=triton"][1], results["adam_tree=reference"][1]
  for n in shapes:
    if n == "bias":   # float32 moments: the jnp step on both paths
      np.testing.assert_allclose(np.asarray(p1[n]), np.asarray(p0[n]), rtol=1e-6)
      continue
    compare_steps((p1[n], s1.mu[n], s1.nu[n]), (p0[n], s0.mu[n], s0.nu[n]), params[n])


def test_tree_step_puts_the_grad_scale_in_the_step_scalars(monkeypatch):
  """Fused clipping: tree_step's scalars operand (the one `adam_rows` reads) carries grad_scale
  in slot 9 (1.0 without), and the dispatch forwards its grad_scale to tree_step."""
  scalars = []

  class FakeJT:
    @staticmethod
    def triton_call(*operands, kernel, out_shape, grid, input_output_aliases, **meta):
      scalars.append(np.asarray(operands[0]))
      return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

  monkeypatch.setattr(tk, "available", lambda: True)
  monkeypatch.setattr(tk, "_kernel", lambda rows, starts, decay: None)
  monkeypatch.setattr(tk.call_triton, "triton_call", FakeJT.triton_call)
  f8 = jnp.float8_e4m3fn
  m = (jnp.zeros((2, 128), f8), jnp.ones((2, 1)), jnp.ones((2, 1), jnp.uint8))
  kw = dict(count=jnp.int32(1), m_fmax=448.0, v_fmax=448.0, m_log2_range=16.6, v_log2_range=16.6,
            group_size=G, expand=True, expand_min=EM, **HYPER)
  for scale in (None, jnp.float32(0.3)):
    tk.tree_step([jnp.ones((2, 128))], [jnp.ones((2, 128))], [m], [m], [True], grad_scale=scale,
                 **kw)
  assert scalars[0][9] == 1.0 and scalars[1][9] == np.float32(0.3)
  np.testing.assert_array_equal(scalars[0][:9], scalars[1][:9])

  seen = {}
  monkeypatch.setattr(kernels_adam, "_tree_kernel_leaves", lambda *a: [0])
  monkeypatch.setattr(tk, "tree_step", lambda *a, **k: seen.update(k) or [(a[1][0], m, m)])
  em = expansion.ExpandedMoment(*m)
  kernels_adam.coat_adam_tree_step([jnp.ones((2, 128))], [jnp.ones((2, 128))], [em], [em], [True],
                              count=jnp.int32(1), grad_scale=jnp.float32(0.3), **STEP)
  assert float(seen["grad_scale"]) == np.float32(0.3)

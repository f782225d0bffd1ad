"""coat_adamw's packed state layout (coat_jax.packed_state): the same steps as the per-leaf layout
to the bit, the layout's alignment and bounds, pack / unpack, the errors, shardings, orbax."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from coat_jax import formats, packed_state
from coat_jax.expansion import ExpandedMoment, metadata_shape
from coat_jax.optim import coat_adamw, coat_adamw_apply, optimizer_state_bytes, state_shardings

G = 128
# A tree with every kind of leaf: last-axis groups, a stacked Flax kernel (COAT's layout, axis
# -2), a short final group (200 % 128), a 0-d and a small leaf (float32 moments), bfloat16.
SHAPES = {"embed": (64, 256), "mlp": {"kernel": (3, 256, 128)}, "odd": (40, 200),
          "norm": (256,), "scalar": (), "half": {"kernel": (256, 64)}}


def _tree(rng, scale=1.0):
  def leaf(shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)
  tree = jax.tree.map(leaf, SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  tree["half"]["kernel"] = tree["half"]["kernel"].astype(jnp.bfloat16)
  return tree


def _bits(x):
  return np.asarray(x).reshape(-1).view(np.uint8)


def _assert_trees_identical(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(_bits(x), _bits(y))


def _assert_trees_equal_to_rounding(a, b):
  """Same values up to the last bit of the float arithmetic: XLA fuses the packed step's slices
  differently from the per-leaf step (an FMA contracted in one and not the other), which moves
  some elements by one ulp of their dtype (seen: 1 param in 32768, 4-5 % of a small leaf's
  float32 group maxima) and, through them, an FP8 code by one step. At least 90 % of each leaf's
  elements must be bit-identical, the others one ulp (floats) or one code (FP8 / int8) away; a
  slot read from the wrong place differs everywhere."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype
    x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
    width = x.dtype.itemsize
    ints = {1: np.int8, 2: np.int16, 4: np.int32}[width]
    xi, yi = x.view(ints).astype(np.int64), y.view(ints).astype(np.int64)
    # ordered integer codes: for sign-magnitude floats, negative values count down
    if x.dtype.kind in "fV" or jnp.issubdtype(x.dtype, jnp.floating):
      top = 1 << (8 * width - 1)
      xi = np.where(xi < 0, -(xi + top), xi)
      yi = np.where(yi < 0, -(yi + top), yi)
    steps = np.abs(xi - yi)
    assert steps.max() <= 1, (x.dtype, steps.max())
    assert np.mean(steps == 0) >= 0.9, (x.dtype, np.mean(steps == 0))


def _slots(tx_kwargs, params):
  from coat_jax.optim import group_axes
  leaves = jax.tree.leaves(params)
  axes = jax.tree.leaves(group_axes(tx_kwargs.get("group_axis", formats.OPTIMIZER_GROUP_AXIS), params))
  q = [np.size(p) >= tx_kwargs.get("min_quantized_size", 4096) for p in leaves]
  return packed_state.layout([np.shape(p) for p in leaves], q,
                             [a if qi else -1 for a, qi in zip(axes, q)], G)[0]


@pytest.mark.parametrize("kwargs", [
    dict(min_quantized_size=1000, group_axis="coat"),
    dict(min_quantized_size=1000, group_axis="last", m_format="e5m2", max_grad_norm=0.5),
    dict(min_quantized_size=1000, master_rounding="stochastic", expand=False),
    dict(min_quantized_size=1000, master_rounding="kahan", v_format="int8"),
])
def test_packed_steps_equal_per_leaf_steps(rng, kwargs):
  """Three steps of coat_adamw_apply and of the optax form from each layout's init: the same
  params and updates, and the packed state's slices the per-leaf state's leaves (to the last
  bit of float rounding: `_assert_trees_equal_to_rounding`)."""
  params = _tree(rng, 0.1)
  grads = [_tree(rng, float(np.exp(rng.uniform(-3, 1)))) for _ in range(3)]
  results = {}
  for layout in ("leaves", "packed"):
    init = coat_adamw(1e-2, weight_decay=0.05, state_layout=layout, **kwargs).init
    apply = jax.jit(coat_adamw_apply(1e-2, weight_decay=0.05, state_layout=layout, **kwargs))
    p, state = params, init(params)
    for g in grads:
      p, state = apply(g, state, p)
    upd = None
    if kwargs.get("master_rounding", "nearest") == "nearest":
      tx = coat_adamw(1e-2, weight_decay=0.05, state_layout=layout, **kwargs)
      upd, _ = jax.jit(tx.update)(grads[0], state, p)
    results[layout] = (p, state, upd)
  (p_l, s_l, u_l), (p_p, s_p, u_p) = results["leaves"], results["packed"]
  _assert_trees_equal_to_rounding(p_l, p_p)
  _assert_trees_equal_to_rounding(u_l, u_p)
  assert not np.allclose(np.asarray(p_p["embed"]), np.asarray(params["embed"]))
  assert isinstance(s_p.mu, packed_state.PackedMoments)
  slots = _slots(kwargs, params)
  for tree_l, packed in ((s_l.mu, s_p.mu), (s_l.nu, s_p.nu)):
    leaves = jax.tree.leaves(tree_l, is_leaf=lambda x: isinstance(x, ExpandedMoment))
    _assert_trees_equal_to_rounding(leaves, packed_state.unpack(packed, slots, G))
  if s_l.comp is not None:   # Kahan: compare the master values p + c (a 1-ulp move of the
    # float32 result can flip which half, p or c, holds the last bits)
    master = lambda p, c: np.asarray(p, np.float32) + np.asarray(c, np.float32)
    np.testing.assert_allclose(master(p_p["half"]["kernel"], s_p.comp["half"]["kernel"]),
                               master(p_l["half"]["kernel"], s_l.comp["half"]["kernel"]),
                               rtol=2.0**-15)
  else:
    assert s_p.comp is None
  np.testing.assert_array_equal(s_l.count, s_p.count)


def test_layout_slots_are_aligned_disjoint_and_cover_each_leaf():
  shapes = [(64, 256), (3, 256, 128), (40, 200), (256,), (), (7,), (128,)]
  quantized = [True, True, True, False, True, False, True]
  axes = [-1, -2, -1, -1, -1, -1, -1]
  slots, groups, plain = packed_state.layout(shapes, quantized, axes, G)
  spans = []
  for s, shape, q, axis in zip(slots, shapes, quantized, axes):
    assert s.quantized == q and s.shape == shape
    if q:
      assert s.start % packed_state.SEGMENT == 0
      assert s.groups == int(np.prod(metadata_shape(shape, G, axis)))
      assert s.size <= s.groups * G     # the codes fit the slot's groups
      spans.append((s.start, s.start + s.groups))
  spans.sort()
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
  assert spans[-1][1] <= groups and groups % packed_state.SEGMENT == 0
  assert groups - sum(b - a for a, b in spans) < packed_state.SEGMENT * len(spans)
  assert plain == 256 + 7
  assert [s.start for s in slots if not s.quantized] == [0, 256]


def test_pack_then_leaf_returns_each_moment(rng):
  shapes, axes = [(64, 256), (2, 256, 96), (5, 130)], [-1, -2, -1]
  moments = []
  for shape, axis in zip(shapes, axes):
    meta = metadata_shape(shape, G, axis)
    moments.append(ExpandedMoment(
        jnp.asarray(rng.standard_normal(shape), jnp.float8_e4m3fn),
        jnp.asarray(rng.uniform(0.5, 2.0, meta), jnp.float32),
        jnp.asarray(rng.integers(1, 255, meta), jnp.uint8)))
  moments.append(jnp.asarray(rng.standard_normal((9,)), jnp.float32))
  slots = packed_state.layout([*shapes, (9,)], [True, True, True, False], [*axes, -1], G)[0]
  packed = packed_state.pack(moments, slots, G, jnp.float8_e4m3fn)
  _assert_trees_identical(packed_state.unpack(packed, slots, G), moments)
  # with_leaf replaces one slot and nothing else
  new = ExpandedMoment(moments[1].data * 0 + 1, moments[1].amax + 1, moments[1].k_code * 0 + 3)
  changed = packed_state.with_leaf(packed, slots[1], new, G)
  got = packed_state.unpack(changed, slots, G)
  _assert_trees_identical([got[0], got[2], got[3]], [moments[0], moments[2], moments[3]])
  _assert_trees_identical(got[1], new)


def test_packed_state_bytes_are_the_leaves_bytes_plus_padding(rng):
  params = _tree(rng)
  kw = dict(min_quantized_size=1000)
  leaves = optimizer_state_bytes(coat_adamw(1e-3, **kw).init(params))
  packed = optimizer_state_bytes(coat_adamw(1e-3, state_layout="packed", **kw).init(params))
  slots = _slots(kw, params)
  pad_groups = sum(-s.groups % packed_state.SEGMENT for s in slots if s.quantized)
  pad_codes = sum(-(-s.groups // 16) * 16 * G - s.size for s in slots if s.quantized)
  tag = packed_state.fingerprint(slots, G)   # the layout's fingerprint: that many uint8 zeros
  assert packed - leaves == 2 * (pad_codes + 5 * pad_groups + tag)   # 1 B codes, 4 + 1 B metadata
  assert packed > leaves


def test_packed_init_equals_packing_the_per_leaf_init(rng):
  params = _tree(rng)
  kw = dict(min_quantized_size=1000)
  s_l = coat_adamw(1e-3, **kw).init(params)
  s_p = coat_adamw(1e-3, state_layout="packed", **kw).init(params)
  slots = _slots(kw, params)
  is_m = lambda x: isinstance(x, ExpandedMoment)
  for tree_l, packed in ((s_l.mu, s_p.mu), (s_l.nu, s_p.nu)):
    _assert_trees_identical(packed_state.unpack(packed, slots, G),
                            jax.tree.leaves(tree_l, is_leaf=is_m))


def test_layout_mismatches_and_bad_values_raise_one_clear_error(rng):
  params = _tree(rng, 0.1)
  grads = _tree(rng)
  leaves_tx = coat_adamw(1e-3, min_quantized_size=1000)
  packed_tx = coat_adamw(1e-3, min_quantized_size=1000, state_layout="packed")
  with pytest.raises(ValueError, match="packed layout; this coat_adamw was made with "
                                       "state_layout='leaves'"):
    leaves_tx.update(grads, packed_tx.init(params), params)
  with pytest.raises(ValueError, match="per-leaf layout; this coat_adamw was made with "
                                       "state_layout='packed'"):
    packed_tx.update(grads, leaves_tx.init(params), params)
  other = coat_adamw(1e-3, min_quantized_size=1000, state_layout="packed", group_axis="coat")
  with pytest.raises(ValueError, match="packed mu was made for another layout"):
    other.update(grads, packed_tx.init(params), params)
  # same buffer sizes, other group axis: caught by the layout's fingerprint
  square = {"w": {"kernel": jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)}}
  by_axis = {a: coat_adamw(1e-3, state_layout="packed", group_axis=a, min_quantized_size=1000)
             for a in ("last", "coat")}
  state = by_axis["last"].init(square)
  assert [x.shape for x in state.mu[:4]] == [x.shape for x in by_axis["coat"].init(square).mu[:4]]
  with pytest.raises(ValueError, match="packed mu was made for another layout"):
    by_axis["coat"].update(square, state, square)
  with pytest.raises(ValueError, match="state_layout must be one of"):
    coat_adamw(1e-3, state_layout="flat")


def test_packed_state_shardings_replicate_on_one_device_and_refuse_a_mesh(rng):
  params = _tree(rng, 0.1)
  state = coat_adamw(1e-3, min_quantized_size=1000, state_layout="packed").init(params)
  one = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  shard = lambda mesh: jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
  sh = state_shardings(shard(one), state)
  assert isinstance(sh.mu, packed_state.PackedMoments)
  placed = jax.device_put(state, sh)
  _assert_trees_identical(placed, state)
  if len(jax.devices()) < 2:
    pytest.skip("one device")
  two = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
  with pytest.raises(ValueError, match="one device's layout and this mesh has 2 devices"):
    state_shardings(shard(two), state)


def test_packed_state_round_trips_through_orbax(rng, tmp_path):
  import orbax.checkpoint as ocp
  params = _tree(rng, 0.1)
  tx = coat_adamw(1e-3, min_quantized_size=1000, state_layout="packed")
  state = jax.jit(tx.update)(_tree(rng), tx.init(params), params)[1]
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "s", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "s", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  _assert_trees_identical(restored, state)


def test_packed_optax_form_composes_with_a_chain(rng):
  """chain(clip_by_global_norm, coat_adamw(packed)) equals the per-leaf chain."""
  params = _tree(rng, 0.1)
  grads = _tree(rng, 3.0)
  out = {}
  for layout in ("leaves", "packed"):
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     coat_adamw(1e-2, min_quantized_size=1000, state_layout=layout))
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    out[layout] = u
  _assert_trees_equal_to_rounding(out["leaves"], out["packed"])


@pytest.mark.gpu
@pytest.mark.parametrize("output", ["param", "update"])
def test_gpu_packed_kernel_equals_per_leaf_kernel(rng, monkeypatch, output):
  """On the GPU the packed state's quantized leaves step in the jax-triton kernel at their slots
  (one launch per leaf, chained through the buffers): params / updates and moments bit-identical
  to the per-leaf kernel's, for rows (embed) and columns (COAT's layout: the kernels), donated
  and not; the float32-moment leaves (reference step) to rounding. One device's path. The first
  leaf is 16 groups, so the next slot starts at group 16: seg_arg 1, which jax-triton passes as a
  constant (it failed to compile before tl.cast)."""
  from coat_jax import kernels
  from coat_jax.kernels import backends
  monkeypatch.setattr(backends, "per_shard", lambda: False)
  assert kernels.implementation("adam") == "triton"
  shapes = {"a_small": (16, 128), "embed": (512, 256), "mlp": {"kernel": (2, 256, 384)},
            "o": {"kernel": (384, 256)}, "norm": (256,)}
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 1e-2, jnp.float32),
                        params) for _ in range(3)]
  out = {}
  for layout in ("leaves", "packed"):
    kw = dict(weight_decay=0.1, state_layout=layout, min_quantized_size=1000)
    tx = coat_adamw(1e-3, **kw)
    state = tx.init(params)
    if output == "param":
      step = jax.jit(coat_adamw_apply(1e-3, **kw), donate_argnums=(1, 2))
      hlo = step.lower(grads[0], state, params).as_text()
      p = jax.tree.map(jnp.copy, params)
      for g in grads:
        p, state = step(g, state, p)
      res = p
    else:
      step = jax.jit(tx.update)
      hlo = step.lower(grads[0], state, params).as_text()
      for g in grads:
        res, state = step(g, state, params)
    assert hlo.count("triton_kernel_call") >= 4, layout   # a_small, embed, mlp, o in the kernel
    out[layout] = (res, state)
  (r_l, s_l), (r_p, s_p) = out["leaves"], out["packed"]
  for name in ("a_small", "embed", "mlp", "o"):
    _assert_trees_identical(r_l[name], r_p[name])
  _assert_trees_equal_to_rounding(r_l["norm"], r_p["norm"])
  slots = _slots(dict(min_quantized_size=1000), params)
  assert slots[1].start == 16   # embed's slot: seg_arg 1
  for tree_l, packed in ((s_l.mu, s_p.mu), (s_l.nu, s_p.nu)):
    leaves = jax.tree.leaves(tree_l, is_leaf=lambda x: isinstance(x, ExpandedMoment))
    got = packed_state.unpack(packed, slots, G)
    for lv, gt, s in zip(leaves, got, slots):
      (_assert_trees_identical if s.quantized else _assert_trees_equal_to_rounding)(lv, gt)
  assert np.isfinite(np.asarray(r_p["embed"])).all()


def test_with_leaf_writes_past_2_31_codes_at_the_right_offset():
  """A slot whose codes start past 2^31 (a 7B model's second half): with_leaf's update keeps
  the offset (int32 update indices wrapped to a negative offset, which XLA clamps to 0: the
  first leaf's codes were overwritten). Checked on the lowered program: no shapes are allocated."""
  big = (2**20, 2**11)   # 2^31 codes, 2^24 groups per leaf
  slots = packed_state.layout([big, big], [True, True], [-1, -1], G)[0]
  assert slots[1].start * G == 2**31
  shapes = packed_state.PackedMoments(
      jax.ShapeDtypeStruct((2**32,), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((2**25,), jnp.float32),
      jax.ShapeDtypeStruct((2**25,), jnp.uint8), jax.ShapeDtypeStruct((0,), jnp.float32),
      jax.ShapeDtypeStruct((packed_state.fingerprint(slots, G),), jnp.uint8))
  moment = ExpandedMoment(jax.ShapeDtypeStruct(big, jnp.float8_e4m3fn),
                          jax.ShapeDtypeStruct((2**20, 16), jnp.float32),
                          jax.ShapeDtypeStruct((2**20, 16), jnp.uint8))
  text = jax.jit(lambda p, m: packed_state.with_leaf(p, slots[1], m, G)).lower(shapes, moment).as_text()
  starts = [int(v) for v in __import__("re").findall(r"dense<(-?\d+)> : tensor<i(?:32|64)>", text)]
  assert 2**24 in starts and not any(v < 0 for v in starts), starts   # row 2^24 of (groups, G)


def test_layout_refuses_float32_moments_past_int32_offsets():
  with pytest.raises(ValueError, match="exceed 2147483647; use state_layout='leaves'"):
    packed_state.layout([(2**31,)], [False], [-1], G)

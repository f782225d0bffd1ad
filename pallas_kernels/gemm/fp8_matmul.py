"""FP8 "TN" matrix product for Hopper through Pallas Mosaic GPU `wgmma`.

Computes out = (scale * (a @ b.T)).astype(out_dtype) for a: (M, K) and b: (N, K), both float8
(e4m3fn or e5m2, mixed allowed), float32 accumulation in the tensor cores, the per-tensor scale
applied in the epilogue. FP8 `wgmma` reads both operands K-major, which is why B comes as (N, K):
its shared-memory tile (tile_n, tile_k) is handed to `wgmma` as a transposed view, K fastest.

Kernel layout (one CTA per SM, persistent over output tiles):
  - warpgroup 2: TMA producer, streams (cta_m, tile_k) tiles of A and (cta_n, tile_k) tiles of B
    into a ring of `stages` shared-memory slots (swizzle 128 B: tile_k = 128 fp8 elements);
  - warpgroups 0, 1: consumers, each owns a (tile_m, tile_n) float32 accumulator in registers and
    issues `wgmma` per K step; the two split the CTA tile along M (default) or N (`wg_dim`);
  - epilogue: acc * scale, cast, staged through swizzled shared memory in (epi_m, epi_n) pieces
    and written with TMA stores, overlapping the next tile's loads; optionally the per-row
    maxima of |scale * acc| (stage 1 of quantizing the output, `with_amax`).
`GemmConfig(schedule="pingpong")` (`pingpong`) instead gives each consumer warpgroup whole
tiles in turn, so that one's epilogue overlaps the other's products; the SwiGLU epilogue kernel
(fp8_gemm_swiglu.py) runs on it.
Shapes that the tiles do not divide are zero-padded in the wrapper (zeros add nothing to the
products) and the output sliced back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KERNEL_NAME = "coat_fp8_gemm_mgpu"  # the kernel's name in profiles and compile breakdowns
SMEM_BYTES = 232448  # H100 per-block shared memory limit (opt-in).
SMEM_RESERVE = 2048  # barriers and bookkeeping.


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tiling of the FP8 GEMM.

  Attributes:
    tile_m, tile_n: one consumer warpgroup's accumulator tile (tile_m multiple of 64).
    tile_k: K per pipeline step; 128 fp8 elements = one 128-byte swizzle row.
    stages: shared-memory ring depth (0 = as many as fit).
    wg_dim: "n" (the two consumers split the CTA tile along N) or "m".
    epi_m, epi_n: epilogue store piece.
    grid_minor: "n" or "m", the fast axis of the tile order.
    grid_tile_width: width of the snake bands over output tiles (L2 reuse).
    cluster_dim: None, or "m" / "n": two CTAs of a cluster take neighbouring CTA tiles along
      that dimension and load the operand they share once, multicast by TMA to both (B's tile
      for "m", A's for "n"); the grid is then the SM count's pairs.
    schedule: "cooperative" (both consumer warpgroups share each CTA tile, split along wg_dim)
      or "pingpong": each consumer warpgroup owns whole (tile_m, tile_n) tiles and the two take
      a CTA's tiles in turn, so that one's epilogue runs while the other's `wgmma` streams (the
      SwiGLU epilogue kernel's layout, fp8_gemm_swiglu.py); wg_dim is then unused and
      cluster_dim must be None.
    mma_in_flight: 0 or 1, the `wgmma` groups a consumer leaves running when a K step returns.
      0: each step waits for its own product, then releases its ring slot. 1: a step waits for
      the previous step's product and releases that slot (`delay_release=1`), so the tensor
      cores never wait for a consumer to issue its next `wgmma`; the last K step of a tile
      waits for its own product too, so that every slot is released only once read. Same
      output bit for bit; on the H200 within 2 % of 0's time on ten of OLMo-1B's and the 7B
      layer's twelve shapes and 8 % less on two (docs/kernels.md), so 1 by default.
  Default: CTA 256 x 128 (two 128 x 128 warpgroup tiles along M), 4 stages of 48 KiB, one
  `wgmma` group in flight; measured best-or-within-noise on the H100 for the square and 7B-layer
  shapes (docs/kernels.md, "The kernels").
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 128
  stages: int = 0
  wg_dim: str = "m"
  epi_m: int = 64
  epi_n: int = 64
  grid_minor: str = "n"
  grid_tile_width: int = 8
  cluster_dim: str | None = None
  schedule: str = "cooperative"
  mma_in_flight: int = 1

  @property
  def cluster_size(self) -> int:
    return 1 if self.cluster_dim is None else 2

  @property
  def cta_m(self) -> int:
    return self.tile_m * (2 if self.wg_dim == "m" and self.schedule == "cooperative" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (2 if self.wg_dim == "n" and self.schedule == "cooperative" else 1)


DEFAULT_CONFIG = GemmConfig()


def _out_slots(cfg: GemmConfig) -> int:
  return min(2, (cfg.tile_m * cfg.tile_n) // (cfg.epi_m * cfg.epi_n))


def smem_bytes_per_stage(cfg: GemmConfig) -> int:
  """Shared memory of one pipeline stage (A and B tiles, 1 byte per element)."""
  return (cfg.cta_m + cfg.cta_n) * cfg.tile_k


def epilogue_smem_bytes(cfg: GemmConfig, out_dtype) -> int:
  return 2 * _out_slots(cfg) * cfg.epi_m * cfg.epi_n * jnp.dtype(out_dtype).itemsize


def max_stages(cfg: GemmConfig, out_dtype) -> int:
  """Deepest ring that fits next to the epilogue buffers."""
  free = SMEM_BYTES - SMEM_RESERVE - epilogue_smem_bytes(cfg, out_dtype)
  return free // smem_bytes_per_stage(cfg)


def validate_config(cfg: GemmConfig, out_dtype) -> GemmConfig:
  """Checks the tiling; fills in `stages` when 0. Raises ValueError naming the problem."""
  if cfg.wg_dim not in ("m", "n") or cfg.grid_minor not in ("m", "n"):
    raise ValueError(f"wg_dim and grid_minor must be 'm' or 'n', got {cfg}")
  if cfg.mma_in_flight not in (0, 1):
    raise ValueError(f"mma_in_flight must be 0 or 1, got {cfg.mma_in_flight!r}")
  if cfg.schedule not in ("cooperative", "pingpong"):
    raise ValueError(f"schedule must be 'cooperative' or 'pingpong', got {cfg.schedule!r}")
  if cfg.schedule == "pingpong" and cfg.cluster_dim is not None:
    raise ValueError(f"schedule='pingpong' takes no cluster_dim, got {cfg.cluster_dim!r}")
  if cfg.cluster_dim not in (None, "m", "n"):
    raise ValueError(f"cluster_dim must be None, 'm' or 'n', got {cfg.cluster_dim!r}")
  if cfg.tile_m % 64:
    raise ValueError(f"tile_m={cfg.tile_m} must be a multiple of 64 (wgmma M)")
  if cfg.tile_n % 8 or cfg.tile_n > 256:
    raise ValueError(f"tile_n={cfg.tile_n} must be a multiple of 8 and <= 256 (wgmma N)")
  if cfg.tile_k % 128:
    raise ValueError(f"tile_k={cfg.tile_k} must be a multiple of 128 (fp8 swizzle row)")
  if cfg.tile_m % cfg.epi_m or cfg.tile_n % cfg.epi_n:
    raise ValueError(f"epilogue tile ({cfg.epi_m}, {cfg.epi_n}) must divide "
                     f"({cfg.tile_m}, {cfg.tile_n})")
  top = max_stages(cfg, out_dtype)
  stages = cfg.stages or top
  if stages > top:
    raise ValueError(f"{stages} stages of {smem_bytes_per_stage(cfg)} B exceed shared memory "
                     f"({SMEM_BYTES} B, at most {top} stages for {cfg})")
  if stages < 2:
    raise ValueError(f"need at least 2 pipeline stages, got {stages}")
  return dataclasses.replace(cfg, stages=stages)


def swizzled(elems_minor: int, dtype):
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(elems_minor * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def num_sms() -> int:
  """The device's SM count (132, an H100 SXM's, where the device reports none): the persistent
  GEMM's default grid. Read in the process that traces the step (a worker exporting the kernel
  has no GPU: the dispatch passes it as num_ctas)."""
  try:
    return jax.devices()[0].core_count
  except (AttributeError, RuntimeError):
    return 132


@functools.lru_cache(maxsize=None)
def _kernel_fn(m: int, n: int, k: int, out_dtype, cfg: GemmConfig, num_ctas: int, interpret,
               with_amax: bool = False, num_scales: int = 1):
  """The jitted pallas kernel for padded (m, n, k) (each divisible by its tile), built once per
  signature: every call of one signature then reuses one traced jaxpr, so JAX lowers it (to
  Mosaic GPU MLIR) once per step instead of once per call site (its lowering cache is keyed on
  the jaxpr; the olmo-1b step has 22 GEMM calls of 9 signatures).

  with_amax: also output float32 (n // tile_n, m): max|scale * acc| per row of each warpgroup
  tile, i.e. per 1 x tile_n group (stored group-major so each store is contiguous).
  num_scales: float32 (1,) scale operands after a and b; the epilogue's scale is their product.
  """
  tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
  cta_m, cta_n = cfg.cta_m, cfg.cta_n
  pair_m, pair_n = cfg.cluster_dim == "m", cfg.cluster_dim == "n"
  m_iters, n_iters, k_iters = m // (cta_m << pair_m), n // (cta_n << pair_n), k // tile_k
  in_transforms = swizzled(tile_k, jnp.float8_e4m3fn)
  out_transforms = swizzled(cfg.epi_n, out_dtype)
  slots = _out_slots(cfg)
  epi_per_row = tile_n // cfg.epi_n
  minor = 0 if cfg.grid_minor == "m" else 1
  in_flight = cfg.mma_in_flight if k_iters > 1 else 0  # a ring of one step keeps none

  def split_refs(refs):
    """(scale, out_gmem, amax_gmem) from the kernel's refs after a and b: the scale operands'
    product (a float32 multiply, rounded as XLA's), then the outputs."""
    scale = functools.reduce(lambda x, y: x * y, [r[0] for r in refs[:num_scales]])
    outs = refs[num_scales:]
    return (scale, *outs) if with_amax else (scale, outs[0], None)

  def epilogue(acc_ref, scale, wg, out_smem, dst, amax_gmem, m0, group):
    """The warpgroup's (tile_m, tile_n) accumulator times scale: its row maxima to amax_gmem
    (with_amax), cast and stored to dst through out_smem in (epi_m, epi_n) pieces."""
    scaled = acc_ref[...] * scale
    if with_amax:
      amax_gmem[group, pl.ds(m0, tile_m)] = jnp.max(jnp.abs(scaled), axis=1)
    out = scaled.astype(out_dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for em in range(tile_m // cfg.epi_m):
      for en in range(epi_per_row):
        rows = slice(em * cfg.epi_m, (em + 1) * cfg.epi_m)
        cols = slice(en * cfg.epi_n, (en + 1) * cfg.epi_n)
        slot = (em * epi_per_row + en) % slots
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
        out_smem[wg, slot] = out[rows, cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst.at[rows, cols])

  def pingpong_body(a_gmem, b_gmem, *refs, out_smem, ring):
    scale, out_gmem, amax_gmem = split_refs(refs)

    def tile(wg, mi, ni, acc_ref):
      dst = out_gmem.at[pl.ds(mi * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)]
      epilogue(acc_ref, scale, wg, out_smem, dst, amax_gmem, mi * tile_m, ni)

    pingpong(a_gmem, b_gmem, ring, tile, grid=(m_iters, n_iters, k_iters),
             tile=(tile_m, tile_n, tile_k), num_ctas=num_ctas, in_flight=cfg.mma_in_flight,
             snake=(minor, cfg.grid_tile_width))

  def body(a_gmem, b_gmem, *refs, out_smem):

    def make_pipeline(step_fn, context_fn):
      return plgpu.emit_pipeline_warp_specialized(
          step_fn,
          grid=(k_iters,),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((cta_m, tile_k), lambda ki: (0, ki), transforms=in_transforms,
                              memory_space=plgpu.SMEM, delay_release=in_flight,
                              collective_axes=("cluster",) if pair_n else ()),
              plgpu.BlockSpec((cta_n, tile_k), lambda ki: (0, ki), transforms=in_transforms,
                              memory_space=plgpu.SMEM, delay_release=in_flight,
                              collective_axes=("cluster",) if pair_m else ()),
          ],
          wg_axis="wg",
          num_compute_wgs=2,
          max_concurrent_steps=cfg.stages,
          compute_context=context_fn,
      )

    unused = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=make_pipeline(unused, unused).get_allocations(a_gmem, b_gmem),
        collective_axes="wg",
    )
    def _scope(allocs):
      wg = lax.axis_index("wg")
      scale, out_gmem, amax_gmem = split_refs(refs)

      pair = lax.axis_index("cluster") if cfg.cluster_dim else 0

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _tile_loop(info):
        (lin,) = info.index
        mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, cfg.grid_tile_width)
        if pair_m:
          mi = mi * 2 + pair
        if pair_n:
          ni = ni * 2 + pair
        cta_rows = pl.ds(mi * cta_m, cta_m)
        cta_cols = pl.ds(ni * cta_n, cta_n)
        if cfg.wg_dim == "m":
          wg_rows, wg_cols = pl.ds(wg * tile_m, tile_m), slice(None)
          b_rows = slice(None)
        else:
          wg_rows, wg_cols = slice(None), pl.ds(wg * tile_n, tile_n)
          b_rows = pl.ds(wg * tile_n, tile_n)
        a_rows = wg_rows

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc_scope(acc_ref):
            run_pipeline(acc_ref)
            epilogue(acc_ref, scale, wg, out_smem,
                     out_gmem.at[cta_rows, cta_cols].at[wg_rows, wg_cols], amax_gmem,
                     mi * cta_m + (wg * tile_m if cfg.wg_dim == "m" else 0),
                     ni * (cta_n // tile_n) + (wg if cfg.wg_dim == "n" else 0))

        def step(idx, a_smem, b_smem, acc_ref):
          plgpu.wgmma(acc_ref, a_smem.at[a_rows], b_smem.at[b_rows].transpose((1, 0)))
          _wait_for_products(idx, in_flight, k_iters)
          return acc_ref

        make_pipeline(step, context)(
            a_gmem.at[cta_rows, :], b_gmem.at[cta_cols, :], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  scratch = dict(out_smem=plgpu.SMEM((2, slots, cfg.epi_m, cfg.epi_n), out_dtype,
                                     transforms=out_transforms))
  if cfg.schedule == "pingpong":
    scratch["ring"] = pingpong_ring(cfg.stages, tile_m, tile_n, tile_k)
  return jax.jit(plgpu.kernel(
      pingpong_body if cfg.schedule == "pingpong" else body,
      out_type=(jax.ShapeDtypeStruct((m, n), out_dtype),
                jax.ShapeDtypeStruct((n // tile_n, m), jnp.float32)) if with_amax
      else jax.ShapeDtypeStruct((m, n), out_dtype),
      scratch_types=scratch,
      grid=(num_ctas // cfg.cluster_size,),
      grid_names=("sm",),
      **(dict(cluster=(2,), cluster_names=("cluster",)) if cfg.cluster_dim else {}),
      num_threads=3,
      thread_name="wg",
      kernel_name=KERNEL_NAME,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret,
  ))


def pingpong_ring(stages: int, tile_m: int, tile_n: int, tile_k: int) -> dict:
  """`pingpong`'s shared memory: the ring's A and B slots, each consumer warpgroup's "full"
  barriers (stages each; both copies of a slot arrive) and the slots' "empty" barriers."""
  fp8 = swizzled(tile_k, jnp.float8_e4m3fn)
  return dict(a=plgpu.SMEM((stages, tile_m, tile_k), jnp.float8_e4m3fn, transforms=fp8),
              b=plgpu.SMEM((stages, tile_n, tile_k), jnp.float8_e4m3fn, transforms=fp8),
              full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),
              empty=plgpu.Barrier(num_arrivals=1, num_barriers=stages))


def pingpong(a_gmem, b_gmem, ring, tile_fn, *, grid, tile, num_ctas, in_flight, snake):
  """The ping-pong schedule of a persistent TN GEMM (warpgroups 0, 1 consumers, 2 producer):
  the producer streams (tile_m, tile_k) tiles of A and (tile_n, tile_k) of B through the ring;
  consumer warpgroup w takes the CTA's j-th output tile where j % 2 == w, runs its K loop into
  a (tile_m, tile_n) float32 accumulator and calls tile_fn(w, mi, ni, acc_ref) (the epilogue),
  which then overlaps the other warpgroup's K loop.

  A consumer waits only on its own "full" barriers, so it sees every phase of each (a barrier
  wait tracks its phase per waiting thread); the producer waits on every release of a slot (the
  last `stages` after its loop, so that no release is pending when the barriers go). With
  in_flight = 1 a consumer keeps one `wgmma` group running and releases each slot a step
  later. grid: (m tiles, n tiles, k steps); tile: (tile_m, tile_n, tile_k); snake: (minor axis,
  band width) of the tile order (`plgpu.planar_snake`).
  """
  m_iters, n_iters, k_iters = grid
  tile_m, tile_n, tile_k = tile
  stages = ring["a"].shape[0]
  a_smem, b_smem, full, empty = ring["a"], ring["b"], ring["full"], ring["empty"]
  tiles = m_iters * n_iters
  wg = lax.axis_index("wg")

  def tile_of(info):
    """(j, mi, ni): the CTA's j-th tile and its place in the output."""
    (lin,) = info.index
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), *snake)
    return info.local_index, mi, ni

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    @plgpu.nd_loop((tiles,), collective_axes="sm")
    def _tile(info):
      j, mi, ni = tile_of(info)
      owner = lax.rem(j, 2)   # the consumer warpgroup of this tile: its "full" barriers

      @pl.loop(0, k_iters)
      def _k_step(ki):
        step = j * k_iters + ki
        slot = lax.rem(step, stages)

        @pl.when(step >= stages)
        def _wait_release():
          plgpu.barrier_wait(empty.at[slot])
        ks = pl.ds(ki * tile_k, tile_k)
        filled = full.at[owner * stages + slot]
        plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(mi * tile_m, tile_m), ks], a_smem.at[slot],
                                filled)
        plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(ni * tile_n, tile_n), ks], b_smem.at[slot],
                                filled)

    # the last `stages` releases, observed before the barriers go
    steps = (tiles - lax.axis_index("sm") + num_ctas - 1) // num_ctas * k_iters

    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _drain(step):
      plgpu.barrier_wait(empty.at[lax.rem(step, stages)])

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")

    @plgpu.nd_loop((tiles,), collective_axes="sm")
    def _tile(info):
      j, mi, ni = tile_of(info)

      @pl.when(lax.rem(j, 2) == wg)
      def _mine():
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          @pl.loop(0, k_iters)
          def _k_step(ki):
            step = j * k_iters + ki
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(full.at[wg * stages + slot])
            plgpu.wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot].transpose((1, 0)))
            if in_flight:
              plgpu.wgmma_wait(1)   # the step before is done: release its slot

              @pl.when(ki > 0)
              def _release():
                plgpu.barrier_arrive(empty.at[lax.rem(step - 1, stages)])
            else:
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(empty.at[slot])

          if in_flight:
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(empty.at[lax.rem(j * k_iters + k_iters - 1, stages)])
          tile_fn(wg, mi, ni, acc_ref)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _wait_for_products(idx, in_flight: int, k_iters: int) -> None:
  """A K step's wait before the pipeline releases a ring slot (`GemmConfig.mma_in_flight`):
  all but `in_flight` of the issued `wgmma` groups done; at a tile's last step, all of them (the
  pipeline never releases the last `in_flight` slots itself, and the producer refills them for
  the next tile once the step before returns)."""
  plgpu.wgmma_wait(in_flight)
  if in_flight:
    @pl.when(idx[0] == k_iters - 1)
    def _last_step():
      plgpu.wgmma_wait(0)


def _pad_to(x: jax.Array, rows: int, cols: int) -> jax.Array:
  pr, pc = rows - x.shape[0], cols - x.shape[1]
  if pr == 0 and pc == 0:
    return x
  return jnp.pad(x, ((0, pr), (0, pc)))


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def check_operands(a: jax.Array, b: jax.Array, out_dtype) -> None:
  """Raises ValueError unless a (M, K), b (N, K) are fp8 and out_dtype is bf16/float32."""
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"fp8_matmul_tn wants 2-D a (M, K) and b (N, K), got {a.shape}, {b.shape}")
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"contracting sizes differ: a {a.shape} vs b {b.shape} (both (., K))")
  if jnp.dtype(a.dtype) not in FP8_DTYPES or jnp.dtype(b.dtype) not in FP8_DTYPES:
    raise ValueError(f"fp8_matmul_tn wants float8 operands, got {a.dtype}, {b.dtype}")
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
  if min(a.shape + b.shape) == 0:
    raise ValueError(f"empty operand: a {a.shape}, b {b.shape}")


def fp8_matmul_tn(a: jax.Array, b: jax.Array, scale: jax.Array, out_dtype=jnp.bfloat16, *,
                  b_scale: jax.Array | None = None, config: GemmConfig = DEFAULT_CONFIG,
                  num_ctas: int | None = None, interpret=None, with_amax: bool = False):
  """(scale * b_scale * a @ b.T).astype(out_dtype) with float32 accumulation.

  Args:
    a: float8 (M, K).
    b: float8 (N, K) (K-major: the "TN" layout FP8 wgmma needs).
    scale: float32 scalar applied to the float32 accumulator: a.scale * b.scale, or a.scale alone
      with b_scale.
    b_scale: optional float32 scalar, b.scale: the kernel multiplies the two scales itself (the
      same float32 product), so that no XLA operation (a kernel launch of its own) makes it.
    out_dtype: bfloat16 or float32.
    config: tiling (`GemmConfig`); `stages=0` takes the deepest ring that fits.
    num_ctas: persistent CTAs (default: the device's SM count).
    interpret: None on the GPU, `plgpu.InterpretGPUParams()` to run on CPU.
    with_amax: also return the epilogue's stage-1 maxima for quantizing the output.
  Returns:
    (M, N) array of out_dtype; with_amax: (out, amax) where amax is float32
    (M, ceil(N / tile_n)), max|scale * acc| per 1 x tile_n group along N in float32 (before the
    cast: cast it to out_dtype for max|out|, rounding is monotonic; NaN propagates).
  """
  check_operands(a, b, out_dtype)
  cfg = validate_config(config, out_dtype)
  (m, k), n = a.shape, b.shape[0]
  mp = _round_up(m, cfg.cta_m * (2 if cfg.cluster_dim == "m" else 1))
  np_ = _round_up(n, cfg.cta_n * (2 if cfg.cluster_dim == "n" else 1))
  kp = _round_up(k, cfg.tile_k)
  a = _pad_to(a, mp, kp)
  b = _pad_to(b, np_, kp)
  scales = [jnp.asarray(s, jnp.float32).reshape(1) for s in (scale, b_scale) if s is not None]
  tiles = (mp // cfg.cta_m) * (np_ // cfg.cta_n)
  if num_ctas is None:
    num_ctas = 2 if interpret is not None else num_sms()
  ctas = min(num_ctas, tiles) // cfg.cluster_size * cfg.cluster_size
  out = _kernel_fn(mp, np_, kp, jnp.dtype(out_dtype), cfg, ctas, interpret, with_amax,
                   len(scales))(a, b, *scales)
  if with_amax:
    out, amax = out
    amax = amax.T[:m, :-(-n // cfg.tile_n)]
    return (out[:m, :n] if (mp, np_) != (m, n) else out), amax
  if (mp, np_) != (m, n):
    out = out[:m, :n]
  return out


# ---------------------------------------------------------------------------------------------
# dot_general planning: which dot_generals reach the TN form (the dispatch, coat_jax.kernels,
# calls the reference for the others).

MIN_DIM = 128  # below this in M, N or K, cuBLASLt (the reference) is the better choice.


def tn_operands(a_data, a_data_t, b_data, b_data_t, dimension_numbers, *,
                min_dim: int = MIN_DIM):
  """Plans `dot_general(a, b, dimension_numbers)` as one TN product a2 (M, K) @ b2 (N, K).T.

  Handled: no batch dims, one contracting dim each; lhs contracting its last axis (leading axes
  folded into M) or, for 2-D lhs, its first axis through `a_data_t`; 2-D rhs contracting axis 1
  (already (N, K)) or axis 0 through `b_data_t`.
  Args:
    a_data, b_data: float8 operands; a_data_t, b_data_t: their transposed copies or None.
  Returns:
    (a2, b2, out_shape, None) when the kernel applies, else (None, None, None, reason).
  """
  def no(reason):
    return None, None, None, reason

  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
  if lb or rb:
    return no("batch dimensions")
  if len(lc) != 1 or len(rc) != 1:
    return no("more than one contracting dimension")
  if jnp.dtype(a_data.dtype) not in FP8_DTYPES or jnp.dtype(b_data.dtype) not in FP8_DTYPES:
    return no(f"non-float8 storage ({a_data.dtype}, {b_data.dtype})")
  if b_data.ndim != 2:
    return no(f"rhs of rank {b_data.ndim}")
  lc, rc = lc[0] % a_data.ndim, rc[0] % 2
  if lc == a_data.ndim - 1:
    a2 = a_data.reshape(-1, a_data.shape[-1])
    lead = a_data.shape[:-1]
  elif a_data.ndim == 2 and lc == 0:
    if a_data_t is None:
      return no("lhs contracts axis 0 and has no data_t")
    a2, lead = a_data_t, a_data.shape[1:]
  else:
    return no(f"lhs contracting axis {lc} of rank {a_data.ndim}")
  if rc == 1:
    b2 = b_data
  elif b_data_t is not None:
    b2 = b_data_t
  else:
    return no("rhs contracts axis 0 and has no data_t")
  if a2.shape[1] != b2.shape[1]:
    raise ValueError(f"contracting sizes differ: lhs {a_data.shape} vs rhs {b_data.shape} "
                     f"for dimension_numbers {dimension_numbers}")
  m, k = a2.shape
  n = b2.shape[0]
  if min(m, n, k) < min_dim:
    return no(f"small problem (M, N, K) = {(m, n, k)} < {min_dim}")
  return a2, b2, tuple(lead) + (n,), None


def interpret_params(interpret: bool):
  """fp8_matmul_tn's `interpret` argument for a bool (Mosaic GPU interpret mode on CPU)."""
  return plgpu.InterpretGPUParams() if interpret else None

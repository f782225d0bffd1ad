"""benchmarks/_hlo.py's HLO helpers (ops and bytes per step through while loops, kernel ->
instruction index) and step/profile_step.py's kernel categories, on a small scan compiled on CPU."""
import jax
import jax.numpy as jnp

from tests.benchmark_scripts import load as _load

common, profile_step = _load("_hlo"), _load("profile_step")


def test_step_stats_counts_loop_bodies_per_trip_and_dus_update_bytes():
  def f(w, x):  # 5 layers: the forward scan stacks tanh(h) (5, 8, 64) f32 for the backward
    def body(h, wi):
      return jnp.tanh(h @ wi), None
    return jnp.sum(jax.lax.scan(body, x, w)[0])

  w, x = jnp.ones((5, 64, 64)) * 0.01, jnp.ones((8, 64))
  text = jax.jit(jax.grad(f)).lower(w, x).compile().as_text()
  stats = common.step_stats(text)
  assert stats["while loops"][0] == 2  # forward and backward loop
  ops, nbytes = stats["DUS fusion (in place)"]
  # Each trip writes one (8, 64) f32 slice per stacked array (not the whole (5, 8, 64) buffer).
  assert ops % 5 == 0 and nbytes % (5 * 8 * 64 * 4) == 0 and 0 < nbytes < ops * 5 * 8 * 64 * 4
  index = common.instruction_index(text)
  assert index and all(len(v) == 3 for v in index.values())
  res = common.scan_residuals(jax.grad(f), w, x)
  assert res[0][0] == 5 and any(s == (5, 8, 64) for s, _ in res[0][2])


def test_kernel_categories():
  cat = profile_step.category
  assert cat("sm90_xmma_gemm_bf16bf16_bf16f32", None) == "bf16 GEMM"
  assert cat("nvjet_e4m3_tst", None) == "FP8 GEMM"
  assert cat("coat_quantize_per_tensor", None) == "quantize"
  assert cat("coat_tile_amax", None) == "quantize"
  # the remake kernel (linear_residuals "remade"), a Triton kernel named by its function
  assert cat("coat_remake_swiglu", ("other", "", "__gpu$xla.gpu.triton")) == "quantize"
  assert cat("coat_adam_step", None) == "optimizer"
  assert cat("cudnn_generated_fort_native_sdpa", None) == "attention"
  assert cat("body", ("other", "", "mosaic_gpu_v2")) == "FP8 GEMM"
  # the GEMM as the profiler names it inside a command buffer (no instruction info): FP8, not a
  # bf16 GEMM
  assert cat("coat_fp8_gemm_mgpu_mosaic_gpu_kernel [command_buffer_25]", None) == "FP8 GEMM"
  # SwiGLU's backward kernel (a Mosaic GPU kernel, not a GEMM): the backward's elementwise work
  assert cat("coat_swiglu_backward_mgpu_mosaic_gpu_kernel [command_buffer_9]", None) == "fusions bwd"
  assert cat("coat_swiglu_backward_mgpu", ("other", "", "mosaic_gpu_v2")) == "fusions bwd"
  assert cat("loop_fusion_3", ("DUS fusion (in place)", "jit(f)/jvp()/while", "")) == "scan DUS/DS/fill"
  assert cat("x", ("other fusion", "jit(f)/transpose(jvp())/while/body/mul", "")) == "fusions bwd"
  assert cat("x", ("other fusion", "jit(f)/jvp()/while/body/mul", "")) == "fusions fwd"
  assert cat("x", ("other fusion", "jit(f)/sqrt", "")) == "optimizer"
  assert cat("x", None) == "unmapped"


def test_idle_gaps_merge_overlapping_kernels_and_name_the_host_work():
  trace = _load("_trace")
  # ns: kernels a/b overlap (two streams), c right after a 10 us gap, d after a 950 us gap
  kernels = [(0, 10_000, "a"), (5_000, 20_000, "b"), (30_000, 40_000, "c"),
             (40_000, 50_000, "d"), (1_000_000, 1_010_000, "e")]
  host = [(0, 2_000_000, "outer"), (22_000, 28_000, "cuLaunchKernel"),
          (100_000, 900_000, "cuStreamSynchronize")]
  busy, span, gaps = trace.idle_gaps(kernels, host)
  assert (busy, span) == (50.0, 1010.0)                     # us: union of kernel time; first..last
  assert [round(g.us) for g in gaps] == [950, 10]           # largest first
  assert (gaps[0].before, gaps[0].after) == ("d", "e") and (gaps[1].before, gaps[1].after) == ("b", "c")
  # innermost (shortest) host events first, with the time they overlap the gap
  assert gaps[0].host[0] == ("cuStreamSynchronize", 800.0) and gaps[0].host[1][0] == "outer"
  assert gaps[1].host[0] == ("cuLaunchKernel", 6.0)


def test_memory_report_parses_and_diffs():
  text = """Memory Space: default (color=0)
Total bytes: 3221225472 (3.00GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    2.00GiB( 67%);    2.00GiB;            0;                2; f32[16,8192,4096], bf16[8,1024]
    3.00GiB(100%);    1.00GiB;   2147483648;                1; f32[8192,16,2048]
"""
  rep = common.memory_report(text)
  assert rep["total_bytes"] == 3 * 2**30
  assert rep["rows"] == [(2 * 2**30, "f32[16,8192,4096], bf16[8,1024]"), (2**30, "f32[8192,16,2048]")]
  other = {"rows": [(2 * 2**30, "f32[16,8192,4096], bf16[8,1024]"), (2**29, "bf16[4,4]")]}
  assert common.memory_report_diff(other, rep) == [(2**30, "f32[8192,16,2048]"), (-(2**29), "bf16[4,4]")]


def test_physical_peak_counts_an_aliased_slot_once():
  """Two names of one loop-carried buffer (same allocation and offset) are one slot: XLA's
  live-range "peak" lists both; the physical peak counts 100 bytes once."""
  assignment = """allocation 0: size 300, preallocated-temp:
 value: <1 while.1{2} (phi) @0> (size=100,offset=0): f32[25]{0}
 value: <2 arg_tuple.3{2} (phi) @0> (size=100,offset=0): f32[25]{0}
 value: <3 fusion.7 @0> (size=200,offset=100): f32[50]{0}
allocation 1: size 50, parameter 0:
 value: <4 p0 @0> (size=50,offset=0): f32[12]{0}
"""
  live = """  BufferLiveRange:
    while.1{2}:2-6
    arg_tuple.3{2}:1-5
    fusion.7{}:6-9
    p0{}:0-9
  Live ranges at 5 (peak):
    while.1{2}: 100 bytes (cumulative: 100 bytes)
    arg_tuple.3{2}: 100 bytes (cumulative: 200 bytes)
    p0{}: 50 bytes (cumulative: 250 bytes)
"""
  slots = common.buffer_slots(assignment)
  assert slots["while.1{2}"] == (0, 0, 100) and slots["fusion.7{}"] == (0, 100, 200)
  peak = common.live_range_peak(live)
  assert peak["bytes"] == 250
  assert common.physical_bytes(peak["buffers"], slots) == (150, 0)
  phys = common.physical_peak(live, slots)
  assert (phys["time"], phys["bytes"]) == (6, 350)   # while.1 + fusion.7 + p0 at position 6
  assert phys["buffers"][0] == ("fusion.7{}", 200)


def test_kernel_events_count_launches_and_the_report_prints_them(monkeypatch, capsys):
  """Time and launches per (kernel, HLO instruction); the largest-kernels list prints launches per
  step, and still reads reports written before it carried them."""
  class Ev:
    def __init__(self, name, op, ns):
      self.name, self.stats, self.duration_ns = name, [("hlo_op", op)], ns
  events = [Ev("quantize", "cb_1", 4000), Ev("quantize", "cb_1", 6000), Ev("gemm", "cb_1", 9000),
            Ev("quantize", "cb_2", 1000)]
  monkeypatch.setattr(profile_step, "gpu_kernel_events", lambda data: [(None, e) for e in events])
  us, calls = profile_step.kernel_events(None)
  assert us[("quantize", "cb_1")] == 10.0 and calls[("quantize", "cb_1")] == 2
  assert calls[("gemm", "cb_1")] == 1 and calls[("quantize", "cb_2")] == 1
  r = {"variant": "coat:loop", "category_ms": {"quantize": 0.01}, "kernel_ms": 0.02,
       "step_ms": 0.03, "compile_s": 1.0, "hlo_categories": {}, "gaps": {},
       "top": [[0.005, "quantize", "quantize [cb_1]", "bf16[8]", 17.0],
               [0.004, "FP8 GEMM", "gemm [cb_1]", "bf16[4]"]]}   # the second: an older report
  profile_step.print_table([r])
  lines = capsys.readouterr().out.splitlines()
  row = next(line for line in lines if "quantize [cb_1]" in line)
  assert row.split()[:3] == ["0.005", "17", "quantize"]
  old = next(line for line in lines if "gemm [cb_1]" in line)
  assert old.split()[:2] == ["0.004", "FP8"]


def test_summary_counts_small_kernels_and_adds_up_kernels_by_shape(capsys):
  """Launches per category, the kernels under SMALL_KERNEL_US on average counted apart, and the
  per-instruction kernels of a step without command buffers added up by kernel and shape."""
  small = profile_step.SMALL_KERNEL_US
  times = {("gemm", "mm.1"): 300.0, ("gemm", "mm.2"): 100.0, ("gemm", "mm.3"): 50.0,
           ("scale_fusion", "fusion.9"): 2 * (small - 1) * 3}       # 3 launches a step, 2 steps
  launches = {("gemm", "mm.1"): 2, ("gemm", "mm.2"): 2, ("gemm", "mm.3"): 2,
              ("scale_fusion", "fusion.9"): 6}
  index = {"mm.1": ("other", "", "mosaic_gpu_v2"), "mm.2": ("other", "", "mosaic_gpu_v2"),
           "mm.3": ("other", "", "mosaic_gpu_v2"),
           "fusion.9": ("other fusion", "jit(f)/jvp()/div", "")}
  shapes = {"mm.1": "bf16[64,32]{1,0} custom-call <- (f8e4m3fn[64,16], f8e4m3fn[32,16]) | jit(f)/a",
            "mm.2": "bf16[64,32]{1,0} custom-call <- (f8e4m3fn[64,16], f8e4m3fn[32,16]) | jit(f)/b",
            "mm.3": "bf16[64,32]{1,0} custom-call <- (f8e4m3fn[64,64], f8e4m3fn[32,64]) | jit(f)/c",
            "fusion.9": "f32[] fusion | jit(f)/jvp()/div"}
  s = profile_step.summarize_kernels(times, launches, index, shapes, iters=2, top=10)
  assert s["category_launches"] == {"FP8 GEMM": 3.0, "fusions fwd": 3.0}
  assert s["small_launches"] == {"fusions fwd": 3.0}
  assert abs(s["small_ms"]["fusions fwd"] - 3 * (small - 1) / 1e3) < 1e-12
  assert abs(s["kernel_ms"] - (0.225 + 3 * (small - 1) / 1e3)) < 1e-12
  # mm.1 and mm.2 (same shapes, op names apart) are one row; mm.3 (another K) its own
  by_shape = {(row[2], row[3]): (row[0], row[4]) for row in s["top_by_shape"]}
  assert by_shape[("gemm", shapes["mm.1"].split(" | ")[0])] == (0.2, 2.0)
  assert by_shape[("gemm", shapes["mm.3"].split(" | ")[0])] == (0.025, 1.0)
  assert len(s["top"]) == 4 and s["top"][0][2] == "gemm [mm.1]"
  r = {"variant": "coat:loop+nocb", "step_ms": 1.0, "compile_s": 1.0, "hlo_categories": {},
       "gaps": {}, **s}
  profile_step.print_table([r])
  out = capsys.readouterr().out
  fwd = next(line for line in out.splitlines() if line.startswith("fusions fwd") and
             len(line.split()) == 5)
  assert fwd.split()[2:] == ["3", "3", f"{3 * (small - 1) / 1e3:.2f}"]
  assert "by kernel and instruction shape" in out


def test_instruction_shapes_name_a_custom_calls_operand_shapes():
  """A compiled module prints a custom call's operands by name only: their shapes are looked up
  (layouts dropped), so that two GEMMs of one output shape and different K are told apart."""
  text = """HloModule m, entry_computation_layout={()->bf16[64,32]{1,0}}

ENTRY %main (p0: f8e4m3fn[64,16], p1: f8e4m3fn[32,16]) -> bf16[64,32] {
  %p0 = f8e4m3fn[64,16]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %mm.1 = bf16[64,32]{1,0} custom-call(%p0, %p1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/gemm"}
}
"""
  shapes = common.instruction_shapes(text)
  assert shapes["mm.1"] == ("bf16[64,32]{1,0} custom-call <- (f8e4m3fn[64,16], f8e4m3fn[32,16]) "
                            "| jit(f)/gemm")
  assert shapes["mm_1"] == shapes["mm.1"]
  # A module XLA compiled here: the CPU's LAPACK call of a Cholesky factorization
  compiled = jax.jit(lambda a: jnp.linalg.cholesky(a * 2.0)).lower(jnp.eye(4)).compile().as_text()
  calls = [v for v in common.instruction_shapes(compiled).values() if " custom-call " in v]
  assert calls and all("<- (f32[4,4])" in v for v in calls)

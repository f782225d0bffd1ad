"""benchmarks/mesh/mesh_collectives.py: the collective parser, and the FP8 linear on an FSDP mesh
gathering its weight as FP8 codes (quantized per shard with the global scale), not as float32."""
from benchmarks.mesh import mesh_collectives as mc

HLO = """HloModule m

%fused_q (p: f32[4,8]) -> f16[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %c = f8e4m3fn[4,8]{1,0} convert(%p)
  ROOT %w = f16[4,8]{1,0} convert(%c)
}

ENTRY %main (a: f32[4,8]) -> f16[32,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %q = f16[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_q
  %ag = f16[32,8]{1,0} all-gather(%q), dimensions={0}
  %ag2 = f32[32,8]{1,0} all-gather(%a), dimensions={0}
  %ar = (f32[4,8]{1,0}, /*index=1*/f32[2]{0}) all-reduce(%a, %a), to_apply=%add
  ROOT %rs = f8e5m2[1,8]{1,0} reduce-scatter(%a), dimensions={0}
}
"""


def test_collectives_parser():
  got = mc.collectives(HLO)
  assert got == [("all-gather", "f16(f8)", 512), ("all-gather", "f32", 1024),
                 ("all-reduce", "f32", 128), ("all-reduce", "f32", 8),
                 ("reduce-scatter", "f8e5m2", 8)]
  assert mc.summarize(got)["all-reduce"] == {"f32": [2, 136]}


def test_fp8_linear_gathers_fp8_codes_on_fsdp_mesh():
  args = mc.parse_args(["--what", "linear", "--tokens", "256", "--hidden", "128", "--ffn", "256"])
  mesh = mc.mesh_lib.make_mesh(mc.MESHES["fsdp8"])
  bf16 = mc.summarize(mc.collectives(mc.linear_hlo("bf16", mesh, args)))
  fp8 = mc.summarize(mc.collectives(mc.linear_hlo("fp8_linear", mesh, args)))
  # bf16: the float32 master weight (128 x 256) gathered for the forward and again for the
  # backward (the linear keeps the sharded parameter as its residual, as FSDP re-gathers)
  assert bf16["all-gather"] == {"f32": [2, 2 * 128 * 256 * 4]}
  # fp8: only FP8 codes are gathered (forward and backward copies; CPU widens them to f16)
  gathered = fp8["all-gather"]
  assert set(gathered) <= {"f16(f8)", "f8e4m3fn"}, gathered
  per_code = {"f16(f8)": 2, "f8e4m3fn": 1}
  assert sum(n // per_code[t] for t, (_, n) in gathered.items()) == 2 * 128 * 256

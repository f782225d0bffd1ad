"""Hugging Face Llama import: logits match transformers (float32) on tiny random checkpoints, and
broken checkpoints give errors that name the file or tensor.

The reference checkpoints come from scripts/make_hf_reference.py, run under .venv-hf (Python 3.11
+ torch + transformers; made by scripts/setup_hf_env.sh). Without .venv-hf those tests skip; the
round trip (our weights written in HF's layout, loaded into the scanned and the looped model) runs
everywhere.
"""
import json
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from coat_jax.models import Llama, LlamaConfig, config_from_hf, layer_params, load_llama
from coat_jax.models.hf import hf_tensor_names

ROOT = Path(__file__).resolve().parents[1]
HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
needs_hf = pytest.mark.skipif(
    not HF_PYTHON.exists(),
    reason=f"{HF_PYTHON} missing: run scripts/setup_hf_env.sh (Python 3.11 + torch + transformers)")


def make_reference(out: Path, variant: str) -> Path:
  subprocess.run([str(HF_PYTHON), str(ROOT / "scripts" / "make_hf_reference.py"), "--out",
                  str(out), "--variant", variant], check=True, capture_output=True, timeout=300)
  return out


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
  return make_reference(tmp_path_factory.mktemp("hf_gqa"), "gqa")


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
  return make_reference(tmp_path_factory.mktemp("hf_llama3"), "llama3_tied")


def max_rel_err(out, ref) -> float:
  return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


@needs_hf
@pytest.mark.parametrize("variant", ["gqa", "llama3_tied"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_logits_match_transformers(variant, scan_layers, gqa_dir, llama3_dir):
  """float32 logits vs transformers' LlamaForCausalLM (GQA; llama3 RoPE, tied, sharded, bf16)."""
  path = gqa_dir if variant == "gqa" else llama3_dir
  model = load_llama(path, precision="bf16", dtype="float32", scan_layers=scan_layers)
  tokens, ref = np.load(path / "tokens.npy"), np.load(path / "logits.npy")
  if variant == "llama3_tied":
    assert model.cfg.tie_embeddings and model.cfg.rope_scaling["factor"] == 8.0
    assert model.cfg.num_kv_heads == 1 and model.cfg.head_dim == 32
  err = max_rel_err(model(jnp.asarray(tokens)), ref)
  print(f"{variant}: max relative logit error vs transformers {err:.2e}")
  assert err < 1e-3


@needs_hf
def test_coat_precision_loads_and_stays_close(gqa_dir):
  model = load_llama(gqa_dir, precision="coat", dtype="bfloat16")
  tokens, ref = np.load(gqa_dir / "tokens.npy"), np.load(gqa_dir / "logits.npy")
  logits = np.asarray(model(jnp.asarray(tokens)))
  assert model.cfg.precision == "coat" and model.layers.mlp.up_proj.kernel.dtype == jnp.float32
  rel = np.linalg.norm(logits - ref) / np.linalg.norm(ref)
  # Each E4M3 GEMM adds ~4% relative error (3 mantissa bits); over this model's layers the logits
  # of a random-weight checkpoint drift by ~12% (measured 0.117). A broken load is ~100%.
  assert rel < 0.15, rel


def copy_checkpoint(src: Path, dst: Path) -> Path:
  shutil.copytree(src, dst)
  return dst


@needs_hf
def test_missing_tensor_is_named(gqa_dir, tmp_path):
  path = copy_checkpoint(gqa_dir, tmp_path / "ckpt")
  tensors = load_file(path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
    load_llama(path)


@needs_hf
def test_wrong_shape_is_named(gqa_dir, tmp_path):
  path = copy_checkpoint(gqa_dir, tmp_path / "ckpt")
  tensors = load_file(path / "model.safetensors")
  name = "model.layers.0.self_attn.k_proj.weight"
  assert tensors[name].shape == (32, 64)
  tensors[name] = np.ones((64, 64), np.float32)
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(ValueError, match=r"k_proj\.weight.*\(64, 64\).*expected \(32, 64\)"):
    load_llama(path)


@needs_hf
def test_missing_shard_is_named(llama3_dir, tmp_path):
  path = copy_checkpoint(llama3_dir, tmp_path / "ckpt")
  shard = sorted(path.glob("model-*.safetensors"))[-1]
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=shard.name):
    load_llama(path)


def to_hf_tensors(model: Llama) -> dict[str, np.ndarray]:
  """Our parameters under HF names, torch's (out, in) layout: the inverse of load_llama."""
  out = {"model.embed_tokens.weight": model.embed.embedding[...],
         "model.norm.weight": model.norm.scale[...]}
  if model.lm_head is not None:
    out["lm_head.weight"] = model.lm_head.kernel[...].T
  for i in range(model.cfg.num_layers):
    for path, value in jax.tree.leaves_with_path(layer_params(model, i)):
      keys = [str(k.key) for k in path if hasattr(k, "key")]
      name = ".".join(keys[:-1])
      out[f"model.layers.{i}.{name}.weight"] = value.T if keys[-1] == "kernel" else value
  return {k: np.asarray(v, np.float32) for k, v in out.items()}


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_into_scanned_and_looped_models(tie, rng, tmp_path):
  """A checkpoint written from a model loads back (scanned and looped) to the same logits."""
  cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=3,
                    num_heads=4, num_kv_heads=2, max_seq_len=64, dtype="float32",
                    tie_embeddings=tie, scan_layers=False)
  src = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  for block in src.layers:  # norms away from 1 so that a mis-mapped norm shows
    for norm in (block.input_layernorm, block.post_attention_layernorm):
      norm.scale[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(64), jnp.float32)
  tensors = to_hf_tensors(src)
  assert sorted(tensors) == sorted(hf_tensor_names(cfg))
  save_file(tensors, tmp_path / "model.safetensors")
  hf_cfg = dict(HF_CONFIG, vocab_size=100, num_hidden_layers=3, rms_norm_eps=1e-6,
                tie_word_embeddings=tie)
  (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
  tokens = jnp.asarray(rng.integers(0, 100, (2, 16)), jnp.int32)
  ref = np.asarray(src(tokens))
  for scan in (True, False):
    model = load_llama(tmp_path, dtype="float32", scan_layers=scan)
    if scan:
      assert model.layers.self_attn.k_proj.kernel.shape == (3, 64, 32)
      assert model.layers.input_layernorm.scale.shape == (3, 64)
    np.testing.assert_allclose(np.asarray(model(tokens)), ref, rtol=1e-5, atol=1e-5)


HF_CONFIG = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False)


def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    load_llama(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_llama(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_llama(tmp_path)


def test_config_mapping_old_and_new_rope_layouts():
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=64)
  old = dict(HF_CONFIG, rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **scaling))
  new = dict(HF_CONFIG, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **scaling))
  for hf in (old, new):
    cfg = config_from_hf(hf, precision="coat")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == scaling
    assert cfg.rms_eps == 1e-5 and cfg.precision == "coat" and not cfg.tie_embeddings
  plain = config_from_hf(dict(HF_CONFIG, rope_parameters=dict(rope_type="default",
                                                              rope_theta=1e4)))
  assert plain.rope_scaling is None and plain.rope_theta == 1e4


@pytest.mark.parametrize("bad,match", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "yarn"),
    (dict(num_key_value_heads=3), "num_kv_heads"),
])
def test_unsupported_configs_rejected(bad, match):
  with pytest.raises(ValueError, match=match):
    config_from_hf(dict(HF_CONFIG, **bad))

"""Hugging Face export and generation: `save_llama` directories load in transformers with our
logits (float32, 1e-4 relative), and `generate`'s greedy ids equal transformers' greedy generate
on the same weights; the KV-cache decoder compiles once per shape, not per token.

The transformers side runs in .venv-hf (scripts/hf_check.py, one process for every variant);
without it those tests skip, the rest runs everywhere.
"""
import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.models import Llama, LlamaConfig, generate, load_llama, save_llama
from coat_jax.models import decode as decode

ROOT = Path(__file__).resolve().parents[1]
HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
needs_hf = pytest.mark.skipif(
    not HF_PYTHON.exists(),
    reason=f"{HF_PYTHON} missing: run scripts/setup_hf_env.sh (Python 3.11 + torch + transformers)")
NEW_TOKENS = 8

# GQA with an untied head (float32, one file, looped layers); Llama 3 RoPE scaling with tied
# embeddings and head_dim != hidden / heads (bfloat16, sharded, scanned layers).
VARIANTS = {
    "gqa": (dict(vocab_size=211, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=64, scan_layers=False), "float32", 1 << 30),
    "llama3_tied": (dict(vocab_size=173, hidden_size=96, intermediate_size=160, num_layers=3,
                         num_heads=4, num_kv_heads=1, head_dim=32, max_seq_len=64,
                         tie_embeddings=True, rope_theta=500000.0, rms_eps=1e-5,
                         rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=16)),
                    "bfloat16", 20_000),
}


def random_model(shape: dict, seed: int) -> Llama:
  """Weights large enough that logits are peaked (greedy ties would make the comparison moot),
  norm scales away from 1 so that a mis-mapped norm shows."""
  cfg = LlamaConfig(dtype="float32", init_std=0.15, **shape)
  model = Llama(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  values = jax.tree.map_with_path(
      lambda path, a: jnp.asarray(1 + 0.2 * rng.standard_normal(a.shape), a.dtype)
      if path[-1].key == "scale" else a, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, values)
  nnx.update(model, state)
  return model


def max_rel_err(out, ref) -> float:
  return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """{variant: (directory, the model as loaded back from it)}, transformers' outputs written in
  each directory (when .venv-hf exists)."""
  out = {}
  for i, (name, (shape, dtype, shard)) in enumerate(VARIANTS.items()):
    directory = tmp_path_factory.mktemp(f"export_{name}")
    model = random_model(shape, seed=100 + i)
    save_llama(model, directory, dtype=dtype, max_shard_bytes=shard)
    rng = np.random.default_rng(i)
    np.save(directory / "tokens.npy", rng.integers(0, shape["vocab_size"], (2, 24), np.int32))
    np.save(directory / "prompt.npy", rng.integers(0, shape["vocab_size"], (2, 7), np.int32))
    out[name] = (directory, model)
  if HF_PYTHON.exists():
    subprocess.run([str(HF_PYTHON), str(ROOT / "scripts" / "hf_check.py"), "--new-tokens",
                    str(NEW_TOKENS), *(str(d) for d, _ in out.values())], check=True,
                   capture_output=True, timeout=600)
  return out


def test_files_and_round_trip(exported):
  """The files transformers expects, and load_llama reads back the exported weights exactly."""
  gqa, _ = exported["gqa"]
  assert (gqa / "model.safetensors").exists()
  assert not (gqa / "model.safetensors.index.json").exists()
  llama3, model = exported["llama3_tied"]
  index = json.loads((llama3 / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 1 and all((llama3 / s).exists() for s in shards)
  hf = json.loads((llama3 / "config.json").read_text())
  assert hf["rope_scaling"]["rope_type"] == "llama3" and hf["tie_word_embeddings"] is True
  assert hf["architectures"] == ["LlamaForCausalLM"] and hf["torch_dtype"] == "bfloat16"
  for name, (directory, model) in exported.items():
    back = load_llama(directory, dtype="float32", scan_layers=model.cfg.scan_layers)
    src = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    dst = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    dtype = jnp.bfloat16 if VARIANTS[name][1] == "bfloat16" else jnp.float32
    for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(dst)):
      np.testing.assert_array_equal(np.asarray(a.astype(dtype), np.float32), np.asarray(b))


def test_refuses_a_directory_holding_a_model(exported, tmp_path):
  directory, model = exported["gqa"]
  with pytest.raises(ValueError, match="already holds a model"):
    save_llama(model, directory)
  with pytest.raises(ValueError, match="dtype"):
    save_llama(model, tmp_path / "x", dtype="int8")


def test_overwrite_replaces_the_model_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
  """overwrite=True: a sharded model over a single-file one leaves only the new files (and the
  directory's other files); a write that fails part way (a full disk) leaves the old model
  loading as before, and no staging folder."""
  from coat_jax.models import hf_export

  shape, _, _ = VARIANTS["gqa"]
  old, new = random_model(shape, seed=1), random_model(shape, seed=2)
  directory = tmp_path / "m"
  save_llama(old, directory, dtype="float32")
  (directory / "notes.txt").write_text("mine")
  logits = lambda m: np.asarray(m(jnp.asarray([[1, 2, 3]])))
  real_save, calls = hf_export.save_file, []

  def full_disk_on_the_second_shard(tensors, path, metadata=None):
    calls.append(path)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    real_save(tensors, path, metadata=metadata)

  monkeypatch.setattr(hf_export, "save_file", full_disk_on_the_second_shard)
  with pytest.raises(OSError, match="No space left"):
    save_llama(new, directory, dtype="float32", max_shard_bytes=20_000, overwrite=True)
  monkeypatch.setattr(hf_export, "save_file", real_save)
  assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors",
                                                         "notes.txt"]
  np.testing.assert_array_equal(logits(load_llama(directory, dtype="float32")), logits(old))
  save_llama(new, directory, dtype="float32", max_shard_bytes=20_000, overwrite=True)
  names = sorted(p.name for p in directory.iterdir())
  assert "model.safetensors" not in names and "model.safetensors.index.json" in names
  assert "notes.txt" in names and not [n for n in names if n.startswith(".")], names
  np.testing.assert_array_equal(logits(load_llama(directory, dtype="float32")), logits(new))


def test_load_with_a_progress_bar_loads_the_same_model(exported, capsys):
  """load_llama(progress=True): a bar over every tensor read, on stderr; the same parameters."""
  directory, model = exported["llama3_tied"]
  capsys.readouterr()
  loaded = load_llama(directory, dtype="float32", progress=True)
  bar = capsys.readouterr().err
  n = 2 + 9 * model.cfg.num_layers   # embedding and final norm (tied head), 9 per layer
  assert f"load {directory.name}" in bar and f" 0/{n} " in bar, bar[-300:]
  quiet = load_llama(directory, dtype="float32")
  for a, b in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)),
                  jax.tree.leaves(nnx.state(quiet, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert capsys.readouterr().err == ""


@needs_hf
@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_logits_and_greedy_generation(name, exported):
  directory, model = exported[name]
  # The exported model itself, its weights rounded as stored (bf16 for the bf16 export).
  stored = nnx.clone(model)
  if VARIANTS[name][1] == "bfloat16":
    state = nnx.state(stored, nnx.Param)
    nnx.update(stored, jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), state))
  tokens = np.load(directory / "tokens.npy")
  err = max_rel_err(stored(jnp.asarray(tokens)), np.load(directory / "hf_logits.npy"))
  print(f"{name}: max relative logit error vs transformers {err:.2e}")
  assert err < 1e-4
  ours = generate(stored, np.load(directory / "prompt.npy"), NEW_TOKENS)
  np.testing.assert_array_equal(np.asarray(ours), np.load(directory / "hf_generated.npy"))


def test_generation_compiles_once_per_shape_and_matches_full_forward(exported, rng):
  """Greedy ids equal argmax over the full (uncached) forward of the growing sequence; the
  decode step traces once for all its tokens and not again for another call of that shape."""
  # Default init (std 0.02): flat logits, so a wrong cache position or mask flips the argmax.
  model = Llama(LlamaConfig(**dict(VARIANTS["gqa"][0], scan_layers=True), dtype="float32"),
                rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  prompt = jnp.asarray(rng.integers(0, 211, (2, 5)), jnp.int32)
  before = dict(decode.TRACES)
  ids = generate(model, prompt, 6)
  traced = {k: decode.TRACES[k] - before.get(k, 0) for k in ("prefill", "step")}
  assert traced == {"prefill": 1, "step": 1}, traced
  generate(model, prompt + 1, 6)
  assert decode.TRACES["step"] - before.get("step", 0) == 1
  # Causal: the full forward's logits at position 4 + i see exactly prompt + ids[:i].
  logits = nnx.jit(lambda m, t: m(t))(model, jnp.concatenate([prompt, ids], 1))
  np.testing.assert_array_equal(ids, jnp.argmax(logits[:, 4:-1], -1))
  # Sampling restricted to the top token (top_k=1) is greedy decoding.
  sampled = generate(model, prompt, 6, temperature=0.7, top_k=1, top_p=0.9,
                     rng=jax.random.key(int(rng.integers(1 << 30))))
  np.testing.assert_array_equal(sampled, ids)


def test_sampling_restrictions(rng):
  """A tiny top_p reduces sampling to the argmax; unrestricted sampling spreads."""
  logits = jnp.asarray(rng.standard_normal((4, 50)) * 3, jnp.float32)
  want = jnp.argmax(logits, -1)
  key = jax.random.key(int(rng.integers(1 << 30)))
  settings = (jnp.float32(1.0), jnp.float32(1e-6))
  sample = jax.jit(decode._sample, static_argnums=2)
  np.testing.assert_array_equal(sample(logits, key, (False, None, True), settings), want)
  spread = sample(jnp.zeros((256, 50)), key, (False, None, False), settings)
  assert len(set(np.asarray(spread).tolist())) > 20


@pytest.mark.parametrize("bad,match", [
    (dict(prompt_ids=np.zeros((2,), np.int32)), "batch, prompt_len"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=100), "max_seq_len"),
    (dict(prompt_ids=np.full((1, 3), 999)), r"\[0, 211\)"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_generate_arguments(bad, match, exported):
  _, model = exported["gqa"]
  args = dict(prompt_ids=np.ones((1, 3), np.int32), max_new_tokens=4) | bad
  with pytest.raises(ValueError, match=match):
    generate(model, args.pop("prompt_ids"), args.pop("max_new_tokens"), **args)

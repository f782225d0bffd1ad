"""A model's life through the command-line entry points, on CPU: train -> export -> fine-tune
from the export (coat, sft data) -> sample; and the pieces: a run's checkpoint loaded outside
train.py (read-only, newest intact or a step), `model.init_from` (weights, tokenizer, one-line
mismatch errors), sft examples (template, mask, packing, errors) and document masking."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import evaluate as evaluate_cli
from coat_jax import export as export_cli
from coat_jax import sample as sample_cli
from coat_jax.models import Llama, LlamaConfig, load_llama
from coat_jax.models.hf_export import hf_tensors
from coat_jax.training import build as build_lib, corpus, load_run_model, mesh as mesh_lib, schema
from coat_jax.training.dataset import TokenDataset
from coat_jax.errors import BadInputError
from coat_jax.training.loop import run
from coat_jax.training.sft import pack, read_examples
from tests.test_training_checkpoint import truncate_data
from tests.test_training_cli import MINI as CLI_MINI

REPO = Path(__file__).resolve().parents[1]
MINI = CLI_MINI + ["run.progress=false", "run.tensorboard=false"]
QUIET = lambda _: None


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("coat_cache")


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory):
  """A 3-step MINI run with checkpoints at steps 2 and 3, and its export."""
  out = tmp_path_factory.mktemp("run")
  run(schema.load(None, MINI + [f"data.cache_dir={cache}", f"run.out_dir={out}", "run.steps=3",
                                "checkpoint.every=2"]), log=QUIET)
  hf = out.parent / f"{out.name}-hf"
  assert export_cli.main([str(out), str(hf)]) == 0
  return out, hf


def params_of(model) -> list[np.ndarray]:
  return [np.asarray(a, np.float32) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_round_trip_train_export_finetune_sample(trained, cache, tmp_path, capsys):
  run_dir, hf = trained
  assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors",
                                                  "tokenizer.json"]
  # The export holds the checkpoint's parameters (rounded to bf16, the default export dtype).
  model, step = load_run_model(run_dir)
  assert step == 3
  exported = load_llama(hf, dtype="float32")
  for a, b in zip(params_of(model), params_of(exported)):
    np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32), b)
  # Fine-tune from the export in coat mode on sft data made from the stdlib.
  data = tmp_path / "sft.jsonl"
  subprocess.run([sys.executable, str(REPO / "scripts" / "make_sft_data.py"), "--out", str(data),
                  "--examples", "48", "--max-chars", "300"], check=True, capture_output=True)
  keep = [m for m in MINI if not m.startswith(("model.", "data.seq_len"))]
  tuned = tmp_path / "sft"
  cfg = schema.load(None, keep + [
      f"model.init_from={hf}", "model.dtype=float32", "precision=coat",
      "optimizer.name=coat_adamw", "data.kind=sft", f"data.paths=[{data}]", "data.seq_len=64",
      "data.eval_fraction=0.1", f"data.cache_dir={cache}", f"run.out_dir={tuned}",
      "run.steps=2"])
  lines = []
  summary = run(cfg, log=lines.append)
  assert summary["step"] == 2 and np.isfinite(summary["train_loss_last"])
  assert any(f"model {hf}" in l and "precision coat" in l for l in lines), lines
  assert (tuned / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
  assert json.loads((tuned / "model.json").read_text())["max_seq_len"] == 64
  # Export the fine-tuned run and sample from it.
  tuned_hf = tmp_path / "sft-hf"
  assert export_cli.main([str(tuned), str(tuned_hf)]) == 0
  capsys.readouterr()
  prompt = 'def add(a, b):\n    """Return a + b."""\n'
  assert sample_cli.main([str(tuned_hf), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
  text = capsys.readouterr().out
  assert text.startswith(prompt) and len(text) > len(prompt) + 1


def test_sample_reads_a_run_directory_as_its_float32_export(trained, tmp_path, capsys):
  """`coat_jax.sample RUN_DIR [--step N]` continues the prompt as the run's float32 export of that
  checkpoint does (greedy: the same text); --step of a missing checkpoint or on a Hugging Face
  directory is a one-line error (exit status 2)."""
  run_dir, hf = trained
  prompt = "def add(a, b):\n    return"

  def sampled(*args) -> str:
    assert sample_cli.main([*args, "--prompt", prompt, "--max-new-tokens", "12",
                            "--dtype", "float32"]) == 0
    return capsys.readouterr().out

  for step in (2, 3):
    hf32 = tmp_path / f"hf32-{step}"
    assert export_cli.main([str(run_dir), str(hf32), "--step", str(step), "--dtype",
                            "float32"]) == 0
    capsys.readouterr()
    text = sampled(str(run_dir), "--step", str(step))
    assert text.startswith(prompt) and len(text) > len(prompt) + 1, text
    assert text == sampled(str(hf32)), step
  assert sampled(str(run_dir)) == sampled(str(tmp_path / "hf32-3"))   # the newest: step 3
  for args, message in (([str(run_dir), "--step", "7"], "no checkpoint at step 7"),
                        ([str(hf), "--step", "2"], "is not a train.py run directory")):
    assert sample_cli.main([*args, "--prompt", prompt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_evaluate_reproduces_the_runs_held_out_loss_from_the_run_and_its_export(trained, tmp_path,
                                                                              capsys):
  """`coat_jax.evaluate RUN_DIR` gives the final eval loss the run logged (its own data, windows
  and precision); the float32 export on the run's config gives the same; other data (shorter
  windows) another finite loss; bad input is one line and exit status 2."""
  run_dir, _ = trained
  logged = json.loads((run_dir / "summary.json").read_text())["final_eval_loss"]
  got = evaluate_cli.evaluate(run_dir, progress=False, log=QUIET)
  assert got["step"] == 3 and got["batches"] == 1 and np.isfinite(got["loss"])
  np.testing.assert_allclose(got["loss"], logged, rtol=1e-5)
  hf32 = tmp_path / "hf32"
  assert export_cli.main([str(run_dir), str(hf32), "--dtype", "float32"]) == 0
  exported = evaluate_cli.evaluate(hf32, config=str(run_dir / "config.yaml"), dtype="float32",
                                   progress=False, log=QUIET)
  np.testing.assert_allclose(exported["loss"], logged, rtol=1e-5)
  no_tok = tmp_path / "no-tok"   # text data needs the model's tokenizer, not a BPE made here
  shutil.copytree(hf32, no_tok)
  (no_tok / "tokenizer.json").unlink()
  at_2 = evaluate_cli.evaluate(run_dir, step=2, batches=2, progress=False, log=QUIET)
  assert at_2["step"] == 2 and at_2["batches"] == 2 and at_2["loss"] != got["loss"]
  shorter = evaluate_cli.evaluate(run_dir, config=str(run_dir / "config.yaml"),
                                  overrides=["data.seq_len=16"], progress=False, log=QUIET)
  assert shorter["tokens"] == got["tokens"] // 2 and np.isfinite(shorter["loss"])
  assert shorter["loss"] != got["loss"]
  capsys.readouterr()
  assert evaluate_cli.main([str(run_dir), "--no-progress"]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert len(out) == 1 and f"held-out loss {logged:.4f}" in out[0], out
  for args, message in (([str(run_dir), "--step", "7"], "no checkpoint at step 7"),
                        ([str(hf32), "--step", "2"], "is not a train.py run directory"),
                        ([str(hf32), "--config", str(run_dir / "config.yaml"), "--set",
                          "data.eval_fraction=0"], "no held-out windows"),
                        ([str(hf32), "--set", "data.seq_len=4096"], "exceeds the model's"),
                        ([str(run_dir), "--batches", "0"], "must be >= 1, got 0"),
                        ([str(no_tok), "--set", "data.vocab_size=300", "--set", "data.seq_len=16"],
                         "has no tokenizer.json: set data.tokenizer"),
                        ([str(tmp_path / "nowhere")], "does not exist")):
    assert evaluate_cli.main([*args, "--no-progress"]) == 2, args
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and message in err[-1], (args, err)


def test_pre_tokenized_data_keeps_the_tokenizer_it_names_for_export_and_sampling(trained, cache,
                                                                                tmp_path, capsys):
  """data.kind tokens with data.tokenizer: the run keeps that tokenizer.json (so its export and
  `coat_jax.sample` read text) and the model keeps the config's vocabulary, not the tokenizer's;
  without data.tokenizer the data has none, as before (and sample says so)."""
  _, hf = trained
  tok = corpus.load_tokenizer(hf)
  texts = corpus.read_texts(corpus.stdlib_files(150_000))
  ids = tmp_path / "ids.npy"
  np.save(ids, corpus.tokenize_documents(tok, texts, corpus.eos_id(tok), np.uint16))
  base = MINI + [f"data.cache_dir={cache}", "data.kind=tokens", f"data.paths=[{ids}]",
                 "model.vocab_size=640", "run.steps=2"]
  with_tok = tmp_path / "with-tok"
  run(schema.load(None, base + [f"data.tokenizer={hf}", f"run.out_dir={with_tok}"]), log=QUIET)
  assert (with_tok / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
  assert json.loads((with_tok / "model.json").read_text())["vocab_size"] == 640
  without = build_lib.dataset_from_config(schema.load(None, base).data, 0, QUIET)
  assert without.tokenizer is None   # the run would keep no tokenizer.json
  capsys.readouterr()
  assert sample_cli.main([str(with_tok), "--prompt", "def f(", "--max-new-tokens", "4"]) == 0
  assert capsys.readouterr().out.startswith("def f(")
  (with_tok / "tokenizer.json").unlink()
  assert sample_cli.main([str(with_tok), "--prompt", "def f("]) == 2
  assert "has no tokenizer.json" in capsys.readouterr().err


def test_init_from_loads_the_weights_with_a_fresh_optimizer_state(trained, cache):
  """Every precision mode starts from the directory's weights; the optimizer state is new."""
  _, hf = trained
  exported = load_llama(hf, dtype="float32")
  for precision, opt in (("bf16", "adamw"), ("coat", "coat_adamw")):
    cfg = schema.load(None, MINI + [f"model.init_from={hf}", f"precision={precision}",
                                    f"optimizer.name={opt}", f"data.cache_dir={cache}"])
    built = build_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh), vocab_size=512)
    assert built.llama_cfg.precision == precision
    params, opt_state, _ = built.init()
    model = built.parts.merge(params, {})
    for a, b in zip(params_of(model), params_of(exported)):
      np.testing.assert_array_equal(a, b)
    counts = [int(x) for path, x in jax.tree.leaves_with_path(opt_state)
              if "count" in jax.tree_util.keystr(path)]
    assert counts and set(counts) == {0}   # no step taken: a fresh optimizer state


def test_init_from_tokenizes_the_stdlib_corpus_with_the_models_tokenizer(trained, cache, tmp_path):
  """A pretrained model trained on the stdlib corpus (data.kind: stdlib) reads ids of its own
  tokenizer, not of a BPE trained here: the windows decode, with the model's tokenizer, to the
  corpus's text."""
  _, hf = trained
  other = tmp_path / "other-tok"
  shutil.copytree(hf, other)
  texts = corpus.read_texts(corpus.stdlib_files(150_000))
  tok = corpus.train_bpe(texts[:3], 300)   # another tokenizer than the run's BPE of 512
  (other / "tokenizer.json").write_text(tok.to_str())
  cfg = schema.load(None, MINI + [f"model.init_from={other}", f"data.cache_dir={cache}"])
  ds = build_lib.dataset_from_config(cfg.data, 0, QUIET, init_from=cfg.model.init_from)
  assert ds.vocab_size == 300 and ds.tokenizer.get_vocab_size() == 300
  ids = np.asarray(ds.arrays[0][:400])
  assert int(np.asarray(ds.arrays[0]).max()) < 300
  first_doc = ids[:list(ids).index(corpus.eos_id(tok))] if corpus.eos_id(tok) in ids else ids
  decoded = tok.decode([int(i) for i in first_doc])
  assert len(decoded) > 200 and texts[0].startswith(decoded), decoded[:200]
  plain = build_lib.dataset_from_config(
      schema.load(None, MINI + [f"data.cache_dir={cache}"]).data, 0, QUIET)
  assert plain.vocab_size == 512 and not np.array_equal(np.asarray(plain.arrays[0][:400]), ids)


def test_init_from_mismatches_are_one_line_errors(trained, cache, tmp_path):
  _, hf = trained
  base = MINI + [f"model.init_from={hf}", f"data.cache_dir={cache}"]
  with pytest.raises(ValueError, match=r"model.hidden_size=48 contradicts .*config.json, whose "
                                       r"model has hidden_size=32"):
    build_lib.model_config(schema.load(None, base + ["model.hidden_size=48"]), None)
  with pytest.raises(ValueError, match=r"tokenizer has 4096 ids, more than the vocab_size=512"):
    build_lib.model_config(schema.load(None, base), 4096)
  no_tok = tmp_path / "no-tok"
  shutil.copytree(hf, no_tok)
  (no_tok / "tokenizer.json").unlink()
  cfg = schema.load(None, base + [f"model.init_from={no_tok}", "data.kind=sft",
                                  f"data.paths=[{no_tok / 'config.json'}]"])
  with pytest.raises(BadInputError, match="has no tokenizer.json: set data.tokenizer"):
    build_lib.dataset_from_config(cfg.data, 0, QUIET, init_from=cfg.model.init_from)
  # pre-tokenized files need no tokenizer: the same directory is fine for them
  ids = tmp_path / "ids.npy"
  np.save(ids, np.arange(4000, dtype=np.uint16) % 512)
  cfg = schema.load(None, base + [f"model.init_from={no_tok}", "data.kind=tokens",
                                  f"data.paths=[{ids}]"])
  ds = build_lib.dataset_from_config(cfg.data, 0, QUIET, init_from=cfg.model.init_from)
  assert ds.num_tokens == 4000 and ds.tokenizer is None
  # A missing directory stops the run before anything is written (train.py: exit status 2).
  with pytest.raises(BadInputError, match=r"^model.init_from: \S*nowhere is not a directory$"):
    run(schema.load(None, MINI + [f"model.init_from={tmp_path / 'nowhere'}",
                                  f"run.out_dir={tmp_path / 'x'}", f"data.cache_dir={cache}"]),
        log=QUIET)
  assert not (tmp_path / "x").exists()


def test_load_run_model_skips_a_damaged_checkpoint_and_changes_nothing(trained, tmp_path):
  run_dir, _ = trained
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  newest, _ = load_run_model(copy)
  older, step = load_run_model(copy, step=2)
  assert step == 2 and any(not np.array_equal(a, b) for a, b in
                           zip(params_of(newest), params_of(older)))
  truncate_data(copy / "checkpoints" / "3")
  before = sorted(str(p) for p in copy.rglob("*"))
  model, step = load_run_model(copy, precision="bf16", scan_layers=False)
  assert step == 2 and not model.cfg.scan_layers
  got, want = hf_tensors(model, "float32"), hf_tensors(older, "float32")   # layout-free names
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])
  assert sorted(str(p) for p in copy.rglob("*")) == before   # read-only: nothing renamed
  with pytest.raises(ValueError, match="no checkpoint at step 7 .* steps there: 2, 3"):
    load_run_model(copy, step=7)
  assert export_cli.main([str(copy), str(tmp_path / "hf"), "--step", "7"]) == 2


@pytest.fixture(scope="module")
def tokenizer():
  texts = ["def f(x):\n    return x + 1\n", "hello world, the user asked a question"] * 20
  return corpus.train_bpe(texts, 300)


def test_sft_template_mask_and_packing(tokenizer, tmp_path):
  eos = corpus.eos_id(tokenizer)
  path = tmp_path / "d.jsonl"
  chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"},
          {"role": "assistant", "content": "world"}]
  path.write_text(json.dumps({"prompt": "def f(x):\n", "response": "    return x"}) + "\n\n"
                  + json.dumps({"messages": chat}) + "\n")
  (ids1, m1), (ids2, m2) = read_examples(path, tokenizer, eos)
  decode = lambda ids: tokenizer.decode([int(i) for i in ids if i != eos])
  assert decode(ids1) == "def f(x):\n    return x" and ids1[-1] == eos
  assert decode(ids1[m1 == 1]) == "    return x" and m1[-1] == 1 and m1.sum() < len(m1)
  assert decode(ids2) == ("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello"
                          "<|user|>\nmore\n<|assistant|>\nworld")
  assert decode(ids2[m2 == 1]) == "helloworld" and (ids2[m2 == 1] == eos).sum() == 2
  rows, cut = pack([(ids1, m1), (ids2, m2), (ids1, m1)], len(ids1) + len(ids2) + 3)
  assert cut == 0 and rows["tokens"].shape[0] == 2
  np.testing.assert_array_equal(rows["segment_ids"][0], [1] * len(ids1) + [2] * len(ids2)
                                + [0] * 3)
  np.testing.assert_array_equal(rows["loss_mask"][0, :len(ids1)], m1)
  short, cut = pack([(ids2, m2)], 5)
  assert cut == 1 and short["tokens"].shape == (1, 5)


@pytest.mark.parametrize("line,match", [
    ("{not json", r"d.jsonl:2: not valid JSON"),
    ('{"prompt": "x"}', r"d.jsonl:2: .*'response'"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"d.jsonl:2: messages\[0\]"),
    ('{"messages": [{"role": "user", "content": "x"}]}', r"d.jsonl:2: .*no assistant"),
])
def test_sft_bad_records_name_file_and_line(line, match, tokenizer, tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + line + "\n")
  with pytest.raises(ValueError, match=match):
    read_examples(path, tokenizer, 0)


def test_document_masking_loss_equals_each_document_alone(rng):
  """Two documents in one window ([a..., eos, b...]): the batch loss is the token-weighted mean
  of each document's own loss (the prediction across the boundary not counted)."""
  eos = 7
  a = rng.integers(8, 64, 6)
  b = rng.integers(8, 64, 9)
  window = np.concatenate([a, [eos], b]).astype(np.int32)
  ds = TokenDataset([window, window], ["a", "b"], seq_len=len(window) - 1, batch_size=1, seed=0,
                    eval_fraction=0.0, eos_id=eos)
  batch = ds.train_batch(0)
  np.testing.assert_array_equal(batch["segment_ids"][0], [1] * 7 + [2] * 9)
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, max_seq_len=32, dtype="float32", loss_impl="logits")
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  doc_a = jnp.asarray(np.concatenate([a, [eos]])[None], jnp.int32)
  doc_b = jnp.asarray(b[None], jnp.int32)

  @nnx.jit
  def losses(m, batch):
    alone = lambda t: m.loss(t[:, :-1], t[:, 1:])
    return (build_lib.batch_loss(m, batch), alone(doc_a), alone(doc_b),
            build_lib.batch_loss(m, batch["tokens"]))

  got, loss_a, loss_b, plain = losses(model, jax.tree.map(jnp.asarray, batch))
  want = (6 * float(loss_a) + 8 * float(loss_b)) / 14
  assert abs(float(got) - want) < 1e-5 * want
  assert abs(float(plain) - want) > 1e-3   # without document masking: another value


@pytest.mark.parametrize("items,match", [
    (["data.kind=tokens", "data.paths=[x.npy]", "data.document_mask=true"], "needs 'data.eos_id'"),
    (["data.kind=sft", "data.paths=[x.jsonl]"], "needs 'data.tokenizer' .* or 'model.init_from'"),
    (["data.kind=sft"], "needs 'data.paths'"),
    (["data.eos_id=-2"], "data.eos_id"),
])
def test_config_checks(items, match):
  with pytest.raises(ValueError, match=match):
    schema.load(None, items)

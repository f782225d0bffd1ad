"""Hostile and careless input gets one line and its exit status, never a silent wrong value: the
config's YAML 1.2 reading and typed `--set` values, text/jsonl data streamed in bounded memory
with errors that name file and line, Hugging Face directories, a damaged checkpoint's reason."""
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from coat_jax.models import load_llama
from coat_jax.training import schema, text_stream
from coat_jax.errors import BadInputError

REPO = Path(__file__).resolve().parents[1]


def test_set_values_are_read_by_the_keys_type():
  cfg = schema.load(None, ["checkpoint.every=010", "run.out_dir=/x/exp #2", 'run.compile_cache=""',
                           "data.kind=tokens", "data.paths=[a.bin, 'b #c.bin']",
                           "run.steps=0x10"])
  assert cfg.checkpoint.every == 10 and cfg.run.steps == 16   # decimal; hex only with 0x
  assert cfg.run.out_dir == "/x/exp #2" and cfg.run.compile_cache == ""
  assert cfg.data.paths == ["a.bin", "b #c.bin"]
  assert schema.load(None, [("run.out_dir", "2024")]).run.out_dir == "2024"   # --out-dir 2024
  for item, pattern in [("run.steps=1:30", "'run.steps' must be an int, got '1:30'"),
                        ("run.progress=yes", "must be a bool"),
                        ("optimizer.lr=.inf", "'optimizer.lr' must be a finite number"),
                        ("optimizer.lr=.nan", "must be a finite number"),
                        ("run.seed=1180591620717411303424", "'run.seed' is out of range"),
                        ("data.batch_size=1000000000000", "tokens per batch is more than 2\\*\\*31")]:
    with pytest.raises(ValueError, match=pattern) as e:
      schema.load(None, [item])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,pattern", [
    ("run:\n  steps: 3\nrun:\n  seed: 1\n", r"key 'run' appears twice \(lines 1 and 3\)"),
    ("a: &x [1, 2]\nb: *x\n", "aliases"),
    ("run:\n  steps: 1:30\n", "'run.steps' must be an int, got str '1:30'"),
])
def test_config_files_refuse_duplicates_aliases_and_yaml_1_1_numbers(tmp_path, text, pattern):
  path = tmp_path / "c.yaml"
  path.write_text(text)
  with pytest.raises(ValueError, match=pattern) as e:
    schema.load(path)
  assert "\n" not in str(e.value)
  path.write_text("checkpoint:\n  every: 010\n")
  assert schema.load(path).checkpoint.every == 10


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({"[UNK]": 0, "ab": 1, "cd": 2, "é": 3}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  path.write_text(tok.to_str())
  return path


def _ids(path, kind, tok_path, cache):
  from coat_jax.training import token_files
  arrays, _, _ = token_files.text_tokens([str(path)], str(tok_path), kind, "text", cache,
                                         log=lambda _: None)
  return np.asarray(arrays[0]).tolist()


def test_long_jsonl_lines_stream_to_the_same_ids(word_tokenizer, tmp_path, monkeypatch):
  records = [{"meta": [1, {"q": "x\"}"}], "text": "ab cd é\u00e9 😀\n ab", "n": None},
             {"text": "cd " * 40, "f": -1.5e3, "t": True}]
  path = tmp_path / "d.jsonl"
  path.write_text("\n".join(json.dumps(r, ensure_ascii=bool(i)) for i, r in enumerate(records)))
  whole = _ids(path, "jsonl", word_tokenizer, tmp_path / "c1")
  monkeypatch.setattr(text_stream, "LONG_LINE_BYTES", 16)
  monkeypatch.setattr(text_stream, "READ_BYTES", 7)
  monkeypatch.setattr(text_stream, "PIECE_CHARS", 8)
  assert _ids(path, "jsonl", word_tokenizer, tmp_path / "c2") == whole
  assert whole == [1, 2, 0, 0, 1] + [2] * 40   # no EOS in this vocabulary; [UNK] is 0


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("payload,pattern", [
    (b'{"text": "ab"}\n{"text": "\\ud800 ab"}\n', r"bad.jsonl:2: .*lone surrogate escape \(\\ud800\)"),
    (b'{"text": "ab"}\n{"text": "\xff"}\n', r"bad.jsonl:2: invalid UTF-8"),
    (b'{"text": "ab"}\n\n{"x": [1}, "text": "ab"}\n', r"bad.jsonl:3: not valid JSON"),
    (b'{"text": 7}\n', r"bad.jsonl:1: field 'text' is"),
])
def test_jsonl_errors_name_file_and_line(word_tokenizer, tmp_path, monkeypatch, long, payload,
                                         pattern):
  if long:
    monkeypatch.setattr(text_stream, "LONG_LINE_BYTES", 8)
  (tmp_path / "bad.jsonl").write_bytes(payload)
  with pytest.raises(BadInputError, match=pattern) as e:
    _ids(tmp_path / "bad.jsonl", "jsonl", word_tokenizer, tmp_path / "c")
  assert "\n" not in str(e.value)


def test_invalid_utf8_in_text_is_an_error_naming_the_line(word_tokenizer, tmp_path, monkeypatch):
  monkeypatch.setattr(text_stream, "READ_BYTES", 5)   # the bad byte in a later read
  (tmp_path / "t.txt").write_bytes(b"ab cd\nab\ncd \xc3\x28 ab\n")
  with pytest.raises(BadInputError, match=r"t.txt:3: invalid UTF-8 \(byte 0xc3 at offset 12\)"):
    _ids(tmp_path / "t.txt", "text", word_tokenizer, tmp_path / "c")


MEMORY_CHILD = textwrap.dedent("""
  import resource, sys
  from coat_jax.training import text_stream, token_files
  text_stream.LONG_LINE_BYTES = 1 << 20
  vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) << 10
  hard = resource.getrlimit(resource.RLIMIT_AS)[1]
  soft = vm + (250 << 20) if hard == resource.RLIM_INFINITY else min(hard, vm + (250 << 20))
  resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
  for path, kind in ((sys.argv[1], "text"), (sys.argv[2], "jsonl")):
    arrays, _, _ = token_files.text_tokens([path], sys.argv[3], kind, "text", sys.argv[4],
                                           log=lambda _: None)
    print(kind, int(arrays[0].shape[0]))
""")


def test_text_and_one_jsonl_line_tokenize_in_bounded_memory(word_tokenizer, tmp_path):
  """3 MB of text and a 3 MB jsonl line under an address-space limit of 250 MB above the
  imports: tokenized as one document each, they took ~500 MB more (and the limit, MemoryError)."""
  words = b"ab cd " * 500_000
  (tmp_path / "big.txt").write_bytes(words)
  (tmp_path / "big.jsonl").write_bytes(b'{"text": "' + words + b'"}\n')
  env = dict(os.environ, MALLOC_ARENA_MAX="2", RAYON_NUM_THREADS="1", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(tmp_path / "big.txt"),
                         str(tmp_path / "big.jsonl"), str(word_tokenizer), str(tmp_path / "c")],
                        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ["text", "1000000", "jsonl", "1000000"]


HF_CONFIG = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64)


def _hf_dir(path: Path, rng, **config) -> Path:
  from coat_jax.models import Llama, LlamaConfig
  from flax import nnx
  from tests.test_hf_import import to_hf_tensors
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, max_seq_len=64, dtype="float32", scan_layers=False)
  path.mkdir()
  save_file(to_hf_tensors(Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))),
            path / "model.safetensors")
  (path / "config.json").write_text(json.dumps(dict(HF_CONFIG, **config)))
  return path


def test_hostile_hugging_face_directories_get_one_line(tmp_path, rng):
  good = _hf_dir(tmp_path / "good", rng)
  assert load_llama(good, dtype="float32").cfg.num_layers == 2
  cases = [(dict(num_attention_heads=0), "num_attention_heads must be a positive integer"),
           (dict(num_hidden_layers=1e9), "num_hidden_layers must be a positive integer"),
           (dict(num_hidden_layers=1000000000), "num_hidden_layers=1000000000, the tensors hold layers 0-1"),
           (dict(num_attention_heads=5), "num_heads=5 must divide"),
           (dict(vocab_size=10**9), "config.json says \\(vocab_size, hidden_size\\)")]
  for i, (config, pattern) in enumerate(cases):
    d = _hf_dir(tmp_path / f"c{i}", rng, **config)
    with pytest.raises(BadInputError, match=pattern) as e:
      load_llama(d, dtype="float32")
    assert "\n" not in str(e.value)
  # A weight_map pointing outside the directory is refused, not read.
  victim = tmp_path / "victim"
  victim.mkdir()
  (victim / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
  hostile = _hf_dir(tmp_path / "hostile", rng)
  (hostile / "model.safetensors").unlink()
  names = json.loads(json.dumps(list(load_llama.__globals__["hf_tensor_names"](
      load_llama(good).cfg))))
  (hostile / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {n: "../victim/model.safetensors" for n in names}}))
  with pytest.raises(BadInputError, match="points outside"):
    load_llama(hostile)
  # A header that lies about its size.
  liar = _hf_dir(tmp_path / "liar", rng)
  data = (liar / "model.safetensors").read_bytes()
  n = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + n])
  first = next(k for k in header if k != "__metadata__")
  header[first]["data_offsets"][1] += 10**6
  blob = json.dumps(header).encode().ljust(n)[:n] if len(json.dumps(header)) <= n else None
  blob = blob or json.dumps(header).encode()
  (liar / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:])
  with pytest.raises(BadInputError, match="model.safetensors: not a readable safetensors file") as e:
    load_llama(liar)
  assert "\n" not in str(e.value)


def test_damaged_checkpoint_reason_is_the_cause_in_one_line_and_no_tracebacks(tmp_path):
  child = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    from coat_jax.training.checkpoint import Checkpointer
    ck = Checkpointer(sys.argv[1], 2, 5, False)
    state = {"w": jnp.arange(2048.0).reshape(64, 32), "m": jnp.ones(100)}
    ck.save(2, state, {"step": 2}); ck.save(4, state, {"step": 4}); ck.close()
    for p in (ck.directory / "4" / "state").rglob("*"):
      if p.is_file() and p.parent.name == "d":
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    ck = Checkpointer(sys.argv[1], 2, 5, False)
    _, _, step = ck.restore_intact(state)
    ck.close()
    print("restored", step)
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.run([sys.executable, "-c", child, str(tmp_path / "ck")], capture_output=True,
                        text=True, timeout=300, env=env, cwd=REPO)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "restored 2" in proc.stdout, out[-3000:]
  assert "Traceback" not in out and "Event loop is closed" not in out, out[-3000:]
  lines = [l for l in out.splitlines() if "unreadable" in l]
  assert len(lines) == 1 and "is not valid for value of size" in lines[0], out[-3000:]
  assert "tensorstore_spec" not in lines[0] and "object at 0x" not in lines[0]


def test_unretrieved_tensorstore_read_failures_are_not_logged_and_other_failures_are(caplog):
  import asyncio
  import gc
  from coat_jax.training.checkpoint import _quiet_orbax
  _quiet_orbax()

  async def fail(message):
    raise ValueError(message)

  def leave_unretrieved(message):
    loop = asyncio.new_event_loop()
    task = loop.create_task(fail(message))
    loop.run_until_complete(asyncio.sleep(0))
    assert task.done()
    loop.close()
    del task
    gc.collect()

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    leave_unretrieved('OUT_OF_RANGE: Error reading "m/.zarray" [tensorstore_spec=\'{}\']')
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    leave_unretrieved("a failure of the user's own task")
  reports = [r for r in caplog.records if r.name == "asyncio"]
  assert len(reports) == 1 and "never retrieved" in reports[0].getMessage(), caplog.text
  assert "user's own task" in str(reports[0].exc_info[1])

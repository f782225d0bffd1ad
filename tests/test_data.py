"""Data: the stdlib corpus and tokenizer cache, token/text/jsonl files, deterministic batches, errors."""
import json

import numpy as np
import pytest

from coat_jax.training import corpus, dataset, token_files
from coat_jax.training.build import dataset_from_config
from coat_jax.training.schema import DataConfig

SMALL = dict(vocab_size=512, corpus_max_bytes=150_000, seq_len=32, batch_size=4, eval_fraction=0.05)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("coat_cache")


@pytest.fixture(scope="module")
def stdlib_ds(cache):
  return dataset_from_config(DataConfig(kind="stdlib", cache_dir=str(cache), **SMALL), seed=3,
                                log=lambda _: None)


def _tokens_cfg(paths, **kw):
  base = dict(kind="tokens", paths=[str(p) for p in paths], seq_len=8, batch_size=4, eval_fraction=0.1)
  base.update(kw)
  return DataConfig(**base)


def test_stdlib_corpus_is_deterministic_and_cached(stdlib_ds, cache, tmp_path):
  ds = stdlib_ds
  assert ds.vocab_size == 512
  ids = np.asarray(ds.arrays[0])
  assert ids.ndim == 1 and ids.size > 10_000
  assert ids.max() < 512 and ids.dtype == np.uint16
  assert ds.tokenizer.token_to_id(corpus.EOS_TOKEN) == 0
  # Both files are cached under a key holding the vocab size and the corpus hash.
  cached = sorted(p.name for p in cache.iterdir())
  assert any(n.startswith("stdlib-v512-") and n.endswith(".tokenizer.json") for n in cached)
  assert any(n.startswith("stdlib-v512-") and n.endswith(".ids.npy") for n in cached)
  # A fresh cache trains the tokenizer again and gets the same ids (BPE training is deterministic).
  fresh = dataset_from_config(DataConfig(kind="stdlib", cache_dir=str(tmp_path), **SMALL), seed=3,
                                 log=lambda _: None)
  np.testing.assert_array_equal(np.asarray(fresh.arrays[0]), ids)
  # The tokenizer round-trips the corpus text.
  files = corpus.stdlib_files(SMALL["corpus_max_bytes"])
  first = files[0].read_text()
  n = len(ds.tokenizer.encode(first).ids)
  assert ds.tokenizer.decode(ids[:n].tolist()) == first


def test_stdlib_files_sorted_prefix():
  small, large = corpus.stdlib_files(50_000), corpus.stdlib_files(150_000)
  assert large[:len(small)] == small and len(large) > len(small)
  assert all("site-packages" not in str(p) for p in large)


def test_batch_is_a_pure_function_of_seed_and_step(stdlib_ds, cache, rng):
  ds = stdlib_ds
  again = dataset_from_config(DataConfig(kind="stdlib", cache_dir=str(cache), **SMALL), seed=3,
                                 log=lambda _: None)
  other_seed = dataset_from_config(DataConfig(kind="stdlib", cache_dir=str(cache), **SMALL), seed=4,
                                      log=lambda _: None)
  step = int(rng.integers(0, 10_000))
  b = ds.train_batch(step)
  assert b.shape == (4, 33) and b.dtype == np.int32
  np.testing.assert_array_equal(b, again.train_batch(step))  # same (seed, step), new object
  assert not np.array_equal(b, ds.train_batch(step + 1))
  assert not np.array_equal(b, other_seed.train_batch(step))
  # Every row is a contiguous window of the corpus starting at a multiple of seq_len.
  ids = np.asarray(ds.arrays[0]).astype(np.int32)
  for row in b:
    starts = np.flatnonzero(ids[: ds.n_train * 32] == row[0])
    assert any(s % 32 == 0 and np.array_equal(ids[s:s + 33], row) for s in starts)


def test_epoch_visits_every_train_window_once_and_eval_is_the_tail(tmp_path, rng):
  tokens = rng.integers(0, 1000, size=8 * 50 + 1).astype(np.uint16)  # 50 windows of 8 (+1)
  path = tmp_path / "t.npy"
  np.save(path, tokens)
  ds = dataset_from_config(_tokens_cfg([path], eval_fraction=0.2, batch_size=5), seed=11)
  assert (ds.n_train, ds.n_eval) == (40, 10)
  seen = np.concatenate([ds.train_batch(s) for s in range(8)])  # 8 x 5 = one epoch
  windows = sorted({tuple(r) for r in seen})
  assert len(windows) == 40  # each train window exactly once
  expected = sorted(tuple(tokens[w * 8:w * 8 + 9].astype(np.int32)) for w in range(40))
  assert windows == expected
  # The next epoch is a different order of the same windows.
  nxt = np.concatenate([ds.train_batch(s) for s in range(8, 16)])
  assert sorted({tuple(r) for r in nxt}) == expected and not np.array_equal(nxt, seen)
  # Eval batches come from the last 10 windows (the last tokens), cycled, and never from train.
  ev = np.concatenate(ds.eval_batches(3))
  tail = {tuple(tokens[w * 8:w * 8 + 9].astype(np.int32)) for w in range(40, 50)}
  assert {tuple(r) for r in ev} == tail


@pytest.mark.parametrize("n", [2, 3, 17, 1000, 4097])
def test_permute_is_a_bijection(n, rng):
  seed, epoch = int(rng.integers(0, 2**31)), int(rng.integers(0, 100))
  p = dataset.permute(np.arange(n), n, seed, epoch)
  assert sorted(p.tolist()) == list(range(n))
  if n > 16:
    assert not np.array_equal(p, np.arange(n))
    assert not np.array_equal(p, dataset.permute(np.arange(n), n, seed, epoch + 1))


def test_token_file_formats(tmp_path, rng):
  t16 = rng.integers(0, 60_000, size=301).astype(np.uint16)
  t32 = rng.integers(0, 100_000, size=301).astype(np.uint32)
  (tmp_path / "a.npy").write_bytes(b"")
  np.save(tmp_path / "a.npy", t16)
  t16.tofile(tmp_path / "b.bin")
  t32.tofile(tmp_path / "c.bin")
  t16.tofile(tmp_path / "olmo-style.npy")  # raw memmap named .npy, as OLMo writes them
  for name, dtype, want in (("a.npy", "uint32", t16), ("b.bin", "uint16", t16),
                            ("c.bin", "uint32", t32), ("olmo-style.npy", "uint16", t16)):
    arr = token_files.load_token_file(tmp_path / name, dtype)
    np.testing.assert_array_equal(np.asarray(arr), want)
  # Several files: windows never cross files; glob patterns expand sorted.
  ds = dataset_from_config(_tokens_cfg([tmp_path / "*.bin"], dtype="uint16", eval_fraction=0.0),
                              seed=0)
  assert ds.names == [str(tmp_path / "b.bin"), str(tmp_path / "c.bin")]


def test_text_and_jsonl_with_a_local_tokenizer(stdlib_ds, tmp_path, rng):
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  (tok_dir / "tokenizer.json").write_text(stdlib_ds.tokenizer.to_str())
  words = ["def", "return", "self", "import", "class", "value", "(", ")", ":", "\n", "    "]
  docs = [" ".join(rng.choice(words, size=int(rng.integers(20, 60)))) for _ in range(12)]
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)))
  (tmp_path / "d.txt").write_text(docs[0])
  cfg = DataConfig(kind="jsonl", paths=[str(tmp_path / "d.jsonl")], tokenizer=str(tok_dir),
                   cache_dir=str(tmp_path / "cache"), seq_len=16, batch_size=2, eval_fraction=0.0)
  ds = dataset_from_config(cfg, seed=0, log=lambda _: None)
  want = []
  for d in docs:
    want += stdlib_ds.tokenizer.encode(d).ids + [0]
  np.testing.assert_array_equal(np.asarray(ds.arrays[0]), want)
  assert ds.vocab_size == 512
  cfg_txt = DataConfig(kind="text", paths=[str(tmp_path / "d.txt")], tokenizer=str(tok_dir / "tokenizer.json"),
                       cache_dir=str(tmp_path / "cache"), seq_len=4, batch_size=2, eval_fraction=0.0)
  ds_txt = dataset_from_config(cfg_txt, seed=0, log=lambda _: None)
  np.testing.assert_array_equal(np.asarray(ds_txt.arrays[0]), stdlib_ds.tokenizer.encode(docs[0]).ids + [0])


def test_errors_name_the_file_and_problem(tmp_path, rng):
  good = tmp_path / "good.bin"
  rng.integers(0, 100, size=200).astype(np.uint16).tofile(good)
  with pytest.raises(ValueError, match="not found.*missing.bin"):
    dataset_from_config(_tokens_cfg([tmp_path / "missing.bin"]), seed=0)
  with pytest.raises(ValueError, match="matches no files"):
    dataset_from_config(_tokens_cfg([tmp_path / "nothing-*.bin"]), seed=0)
  with pytest.raises(ValueError, match="data.dtype"):
    token_files.load_token_file(good, "int8")
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"\x01\x00\x02")
  with pytest.raises(ValueError, match="odd.bin.*not a multiple of 2"):
    dataset_from_config(_tokens_cfg([odd]), seed=0)
  np.save(tmp_path / "float.npy", rng.normal(size=50))
  with pytest.raises(ValueError, match="float.npy must hold integers"):
    dataset_from_config(_tokens_cfg([tmp_path / "float.npy"]), seed=0)
  np.save(tmp_path / "twod.npy", rng.integers(0, 9, size=(5, 5)))
  with pytest.raises(ValueError, match="twod.npy must hold a 1-D array"):
    dataset_from_config(_tokens_cfg([tmp_path / "twod.npy"]), seed=0)
  (tmp_path / "empty.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="empty corpus.*empty.bin"):
    dataset_from_config(_tokens_cfg([tmp_path / "empty.bin"]), seed=0)
  with pytest.raises(ValueError, match="seq_len=512 is longer than the data"):
    dataset_from_config(_tokens_cfg([good], seq_len=512), seed=0)
  # Out-of-vocabulary ids: the file and position are named.
  bad = rng.integers(0, 100, size=200).astype(np.uint16)
  pos = int(rng.integers(0, 200))
  bad[pos] = 100
  bad.tofile(tmp_path / "oov.bin")
  ds = dataset_from_config(_tokens_cfg([tmp_path / "oov.bin"]), seed=0)
  with pytest.raises(ValueError, match=f"token id 100 at position {pos} of .*oov.bin.*vocab_size=100"):
    ds.check_vocab(100)
  ds.check_vocab(101)


def test_large_data_is_vocab_checked_batch_by_batch(tmp_path, rng, monkeypatch):
  monkeypatch.setattr(dataset, "FULL_SCAN_MAX_TOKENS", 0)  # pretend the data is too big to scan
  tokens = rng.integers(0, 50, size=9 * 8 + 1).astype(np.uint16)
  tokens[37] = 77
  tokens.tofile(tmp_path / "big.bin")
  ds = dataset_from_config(_tokens_cfg([tmp_path / "big.bin"], eval_fraction=0.0, batch_size=9),
                              seed=0)
  ds.check_vocab(50)  # no up-front scan
  with pytest.raises(ValueError, match="token id 77 at position 37 of .*big.bin.*vocab_size=50"):
    ds.train_batch(0)  # one batch = every window


def test_text_errors(stdlib_ds, tmp_path):
  tok = tmp_path / "tokenizer.json"
  tok.write_text(stdlib_ds.tokenizer.to_str())
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
  (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
  cfg = lambda p, **kw: DataConfig(kind="jsonl", paths=[str(p)], tokenizer=str(kw.get("tok", tok)),
                                   cache_dir=str(tmp_path / "c"), seq_len=4, batch_size=1)
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
    dataset_from_config(cfg(tmp_path / "bad.jsonl"), seed=0, log=lambda _: None)
  with pytest.raises(ValueError, match=r"nofield.jsonl:2: record has no 'text' field"):
    dataset_from_config(cfg(tmp_path / "nofield.jsonl"), seed=0, log=lambda _: None)
  with pytest.raises(ValueError, match="tokenizer file not found"):
    dataset_from_config(cfg(tmp_path / "bad.jsonl", tok=tmp_path / "nope"), seed=0, log=lambda _: None)

"""The training pipeline as a library: config -> mesh -> data -> model/optimizer/steps -> loop.

  schema.py       RunConfig (the run config's dataclasses and value checks), `load`
  config_io.py    typed dataclasses from mappings, YAML 1.2 core, typed `--set` overrides
  corpus.py       the offline stdlib corpus and its locally trained byte-level BPE
  token_files.py  pre-tokenized, text and JSON-lines files
  text_stream.py  text and JSON lines tokenized in bounded pieces
  dataset.py      windows, the train/eval split, deterministic batches (Feistel permutation)
  mesh.py         device mesh, parameter/batch/optimizer-state shardings
  build.py        `build(cfg, mesh)`: model, optimizer, shardings, jitted steps, init
  accumulate.py   gradient accumulation over microbatches (`optimizer.accumulate`)
  plan.py         before the first step: XLA's predicted peak against the device, `auto` remat
                  and microbatches, the settings that fit (`train.py --plan`)
  loop.py         `run(cfg)`: the loop with checkpoint, metric and stop hooks
  run_dir.py      a run's directories: the lock, what `--overwrite` may remove
  divergence.py   non-finite losses (`run.on_nonfinite`) and non-finite checkpoint states
  errors.py       exit statuses and the errors that carry them
  step_log.py     per-step metrics and the summary line
  checkpoint.py   orbax checkpoints (async, exact resume)
  storage.py      host memory and disk for checkpoints (streamed saves, full disks)
  run_model.py    a run's model outside train.py: `load_run_model(run_dir, step)`
  pretrained.py   starting from a Hugging Face directory (`model.init_from`)
  sft.py          supervised fine-tuning data: chat/prompt-response examples, masked and packed
  metrics.py      throughput, MFU, peak memory, metrics.jsonl + TensorBoard, loss plot
  cli.py          the command line (`coat-train`, `python train.py`): arguments, shipped configs,
                  one-line errors and exit statuses
"""

from coat_jax.training.run_model import load_run_model  # noqa: E402

__all__ = ["load_run_model"]

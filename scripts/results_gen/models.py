"""The model-size and memory tables: the largest Llama each mode trains, the models only coat fits,
gradients summed in place, the step's predicted memory, checkpoints and host memory."""
from __future__ import annotations

import re

from .common import PLAN_LINE, Sources, source_line, summary_field


def big_models(src: Sources) -> list[str]:
  out = ["| model | GPU | recipe | batch | peak GB | tokens/s | MFU | date | raw |",
         "|---|---|---|---|---|---|---|---|---|"]
  def row(model, sid, recipe, base):
    gpu, date, _, raw = src.where(sid, short=True)
    v = lambda k: src.value(sid, f"{base}.{k}")
    out.append(f"| {model} | {gpu} | {recipe} | {v('batch')} | {v('peak_bytes') / 1e9:.2f} | "
               f"{v('tokens_per_s'):,.0f} | {100 * v('mfu'):.1f} % | {date} | {raw} |")
  sr = "coat, bf16 master weights + stochastic rounding, remat full"
  row("Llama-2-7B", "llama2_7b_b8_h100", sr, "equal_batch.0")
  row("Llama-2-7B", "llama2_7b_b16_h100", sr, "equal_batch.0")
  row("Llama-2-7B", "llama2_7b_b8_unrolled_h100", sr + ", layers unrolled", "equal_batch.0")
  gpu, date, _, raw = src.where("llama2_7b_bf16_h200", short=True)
  v = lambda k: src.value("llama2_7b_bf16_h200", k)
  for b in (4, 8):
    mfu = v("b8_mfu") if b == 8 else ""
    out.append(f"| Llama-2-7B | {gpu} | bf16 + optax.adamw, float32 master weights, remat full "
               f"| {b} | {v(f'b{b}_peak_gb'):.2f} | {v(f'b{b}_tokens'):,.0f} | {mfu} | {date} "
               f"| {raw} |")
  for i in (0, 1):
    row("Llama-2-13B", "llama2_13b_h200", sr, f"max_batch.coat+coat_adamw.{i}")
  out += ["", "Commands:", ""]
  for sid in ("llama2_7b_b8_h100", "llama2_7b_b16_h100", "llama2_7b_b8_unrolled_h100",
              "llama2_7b_bf16_h200", "llama2_13b_h200"):
    out.append(f"- `{src.where(sid)[2]}`")
  return out


LLAMA_VOCAB = 32000   # the offline corpus's vocabulary in the largest-model runs


def llama_params(hidden: int, layers: int, ffn: int, vocab: int = LLAMA_VOCAB) -> int:
  """Parameters of a Llama (untied embedding and head, heads of 128 with as many KV heads)."""
  return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


def largest_plans(text: str) -> list[dict]:
  """Each `--plan` section of a log: mode, shape, device limit, fits, predicted GiB, microbatches."""
  plans = []
  for section in text.split("=== largest (")[1:]:
    head = section.split("\n", 1)[0]
    if " --plan" not in head:
      continue
    get = lambda key: re.search(rf"--set {re.escape(key)}=(\S+)", head).group(1)
    # ">" before the peak: a lower bound, the state alone over the device (no compile)
    row = re.search(r"^  (chosen|as configured) +\S+ +(\d+) \S+ +\d+ +(>?)([\d.]+) GiB", section,
                    re.M)
    device = re.search(r"^device: 1 x (.+?), ([\d.]+) GiB each", section, re.M)
    shape = tuple(int(get(k)) for k in ("model.hidden_size", "model.num_layers",
                                        "model.intermediate_size"))
    plans.append(dict(mode=f"{get('precision')} + {get('optimizer.name')}", shape=shape,
                      params=llama_params(*shape), fits=row.group(1) == "chosen",
                      micro=int(row.group(2)), predicted=float(row.group(4)),
                      at_least=row.group(3),
                      device_gib=float(device.group(2))))
  return plans


LARGEST_SOURCES = (("largest_plans_h200", "one H200 (141 GB)"), ("largest_20b_h200", "one H200 (141 GB)"),
                   ("largest_80gb_h200", "one 80 GB GPU"), ("largest_80gb_summed_h200", "one 80 GB GPU"))
# Logs whose coat plans another log planned again with the current memory layout: their bf16 and
# fp8_linear rows only.
BASELINE_ONLY = ("largest_plans_h200", "largest_80gb_h200")


LARGEST_RUN = ("configs_llama_20b_h200", "/tmp/cfg_llama-20b")   # train.py on the largest coat model
LARGEST_RUN_AFTER = "largest_20b_h200"   # its row follows this log's plans


def run_params(src: Sources, sid: str) -> float:
  """The parameter count train.py's `[run] model` line gives in `sid`'s raw log."""
  return src.value(sid, r"re:\[run\] model \S+ \(([\d.]+)M params") * 1e6


def config_run_plan(src: Sources, sid: str) -> dict:
  """The shipped config's train.py run in `sid` as a plan row: its shape (the source's values,
  checked against the run's parameter count) and the `[plan]` line it trained with."""
  text = src.raw(sid)
  m = PLAN_LINE.search(text)
  shape = tuple(int(src.value(sid, k)) for k in ("hidden", "layers", "ffn"))
  params = run_params(src, sid)
  if abs(llama_params(*shape) - params) > 1e5:
    raise ValueError(f"{sid}: the shape {shape} has {llama_params(*shape)} params, the run {params}")
  prec, opt = re.search(r"precision (\S+)\), optimizer (\S+),", text).groups()
  return dict(mode=f"{prec} + {opt}", shape=shape, params=llama_params(*shape), fits=True,
              micro=int(m["micro"]), predicted=float(m["predicted"]),
              device_gib=float(m["limit"]), ran=True)


def _largest_rows(src: Sources):
  """(GPU label, plan, source) for every plan shown: the baseline logs' bf16 and fp8_linear rows,
  the coat logs' rows, and the shipped largest config's train.py run."""
  rows = []
  for sid, gpu in LARGEST_SOURCES:
    for plan in largest_plans(src.raw(sid)):
      if sid in BASELINE_ONLY and plan["mode"].startswith("coat"):
        continue
      rows.append((gpu, plan, sid))
    if sid == LARGEST_RUN_AFTER:
      rows.append((gpu, config_run_plan(src, LARGEST_RUN[0]), LARGEST_RUN[0]))
  return rows


def largest_fits(src: Sources) -> dict[tuple[str, str], tuple[dict, str]]:
  """(GPU label, mode) -> (the largest plan that fits, its source)."""
  best = {}
  for gpu, p, sid in _largest_rows(src):
    if p["fits"] and p["params"] > best.get((gpu, p["mode"]), ({"params": 0}, ""))[0]["params"]:
      best[(gpu, p["mode"])] = (p, sid)
  return best


def _largest_run(src: Sources) -> tuple[float, float, float]:
  """tokens/s, MFU and device peak GiB of the train.py run on the largest coat model."""
  key = lambda field: src.value(LARGEST_RUN[0], summary_field(LARGEST_RUN[1], field))
  return key("tokens_per_s"), key("mfu"), key("peak_memory_bytes") / 2**30


def largest_models(src: Sources) -> list[str]:
  """Every shape planned, per GPU and mode: fits or not, the plan's microbatches and peak."""
  out = ["| GPU | precision + optimizer | hidden x layers | params | fits at 64 x 2048 | "
         "microbatches | predicted peak GiB | train.py tokens/s |", "|---|---|---|---|---|---|---|---|"]
  tokens, mfu, peak = _largest_run(src)
  for gpu, p, sid in _largest_rows(src):
    h, layers, _ = p["shape"]
    ran = f"{tokens:,.0f} ({mfu:.1%} MFU, {peak:.2f} GiB measured)" if p.get("ran") else ""
    out.append(f"| {gpu} | {p['mode']} | {h} x {layers} | {p['params'] / 1e9:.2f}e9 | "
               f"{'yes' if p['fits'] else 'no'} | {p['micro'] if p['fits'] else ''} | "
               f"{p.get('at_least', '')}{p['predicted']:.2f} of {p['device_gib']:.2f} | {ran} |")
  return out + ["", "bf16 and fp8_linear on the H200: " + source_line(src, "largest_plans_h200"),
                "coat on the H200: " + source_line(src, "largest_20b_h200"),
                "coat on the H200, `configs/llama-20b.yaml` through train.py: " +
                source_line(src, LARGEST_RUN[0]),
                "bf16 and fp8_linear on 80 GB: " + source_line(src, "largest_80gb_h200"),
                "coat on 80 GB: " + source_line(src, "largest_80gb_summed_h200")]


def summed_in_place(src: Sources) -> list[str]:
  """coat's largest shapes with the layers' gradient summed in place: the plans, the buffer
  report's total for the 20.3e9 step, and the train.py run."""
  sid, run = "largest_summed_in_place_h200", "/tmp/largest"
  text = src.raw(sid)
  out = ["| hidden x layers | params | microbatches | predicted peak GiB | fits | train.py |",
         "|---|---|---|---|---|---|"]
  for p in largest_plans(text):
    h, layers, _ = p["shape"]
    out.append(f"| {h} x {layers} | {p['params'] / 1e9:.2f}e9 | {p['micro']} | "
               f"{p['predicted']:.2f} of {p['device_gib']:.2f} | {'yes' if p['fits'] else 'no'} | |")
    if p["shape"] == (6144, 44, 16384):
      total = src.value("step_buffers_20b_h200", r"re:Total bytes: \d+ \(([\d.]+)GiB\)")
      out.append(f"| {h} x {layers}, no mean tree after the loop | {p['params'] / 1e9:.2f}e9 | "
                 f"{p['micro']} | {total:.2f} of {p['device_gib']:.2f} | no | |")
  m = PLAN_LINE.search(text)
  key = lambda field: src.value(sid, summary_field(run, field))
  params = run_params(src, sid)
  head = text[:m.start()].rsplit("=== largest (", 1)[1]   # the run's command line
  h, layers = (re.search(rf"--set model\.{k}=(\d+)", head).group(1)
               for k in ("hidden_size", "num_layers"))
  out.append(f"| {h} x {layers} | {params / 1e9:.2f}e9 | {m['micro']} | {float(m['predicted']):.2f} "
             f"of {float(m['limit']):.2f} | yes | {key('tokens_per_s'):,.0f} tokens/s, "
             f"{key('mfu'):.1%} MFU, {key('peak_memory_bytes') / 2**30:.2f} GiB measured |")
  return out + ["", source_line(src, sid),
                "Buffers of the 20.3e9 step: " + source_line(src, "step_buffers_20b_h200")]


def largest_summary(src: Sources) -> list[str]:
  """The README's table: per GPU and mode, the largest shape that fits."""
  best = largest_fits(src)
  out = ["| GPU | bf16 + optax.adamw | fp8_linear + optax.adamw | coat + coat_adamw |",
         "|---|---|---|---|"]
  for gpu in dict.fromkeys(g for _, g in LARGEST_SOURCES):
    cells = []
    for mode in ("bf16 + adamw", "fp8_linear + adamw", "coat + coat_adamw"):
      p = best.get((gpu, mode), (None, ""))[0]
      cells.append("" if p is None else f"{p['params'] / 1e9:.1f}e9 ({p['shape'][0]} x "
                                        f"{p['shape'][1]} layers)")
    out.append(f"| {gpu} | " + " | ".join(cells) + " |")
  tokens, mfu, peak = _largest_run(src)
  run = best[("one H200 (141 GB)", "coat + coat_adamw")][0]
  plans, meta = src.meta[LARGEST_SOURCES[0][0]], src.meta[LARGEST_RUN[0]]
  return out + ["", f"Llama shapes (heads of 128, vocabulary 32000), seq 2048, global batch 64 "
                f"through microbatches, remat full, planned by `train.py --plan` "
                f"({plans['gpu']}, {plans['date']}; the 80 GB GPU is the H200 held to an H100's "
                f"75.22 GiB by `run.device_memory_limit`); the {run['params'] / 1e9:.1f}e9 coat "
                f"model (`configs/llama-20b.yaml`) ran through train.py at {tokens:,.0f} tokens/s "
                f"({mfu:.1%} MFU, {peak:.2f} GiB; {meta['gpu']}, {meta['date']}). Each plan with "
                f"its command and raw log is in docs/results.md, \"The largest model one GPU "
                f"trains\"."]


def step_memory_sr(src: Sources) -> list[str]:
  sid = "step_memory_sr_h200"
  text = src.raw(sid)
  before, after = text.split("## after")
  pat = r"RESULT {}: .*?temp ([\d.]+), predicted_bytes ([\d.]+)"
  rows = []
  for label, part, name in (("stochastic, a loop mapping layers to new stacks", before, "big_sr"),
                            ("round to nearest (no rounding loop)", before, "big_nearest"),
                            ("stochastic, the loop updating the stacks in place", after, "big_sr")):
    m = re.search(pat.format(name), part)
    rows.append(f"| {label} | {float(m.group(1)):.3f} | {float(m.group(2)):.3f} | "
                f"{float(m.group(2)) * 15.5535e9 / 2**30:.2f} |")
  return (["| bfloat16 master weights, rounding step | temporaries B/param | predicted B/param | "
           "predicted GiB |", "|---|---|---|---|"] + rows + ["", source_line(src, sid)])


CHECKPOINT_MEMORY = (("checkpoint_memory_whole_h200", "28 GiB in 64 arrays", ("whole",)),
                     ("checkpoint_memory_batches_h200", "41 GiB in 16 arrays", None),
                     ("checkpoint_memory_13b_h200", "Llama-2-13B's, 49 GiB", None))


def _save_label(mode: str) -> str | None:
  """checkpoint_memory's mode in words ('streamed' without a count in these logs: batches of 1/8);
  None for a cell that is no mode."""
  head, _, host = mode.partition(":")
  kind, _, n = head.partition("/")
  if kind != "streamed":
    return "whole" if kind == "whole" else None
  text = f"streamed, batches of 1/{n or 8}"
  return text + (", into ordinary host memory" if host == "unpinned" else "")


def checkpoint_memory(src: Sources) -> list[str]:
  """Each save of benchmarks/step/checkpoint_memory.py's logs: the rows of its table by column."""
  out = ["| state | save | batch GiB | added GiB | added / state | kept after GiB | seconds |",
         "|---|---|---|---|---|---|---|"]
  for sid, state, modes in CHECKPOINT_MEMORY:
    header = None
    for line in src.raw(sid).splitlines():
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if cells[0] == "save":
        header = cells
      elif (header and len(cells) == len(header) and _save_label(cells[0])
            and (modes is None or cells[0] in modes)):
        row = dict(zip(header, cells))
        out.append(f"| {state} | {_save_label(row['save'])} | {row['batch GiB']} | {row['added GiB']} | "
                   f"{row['added / state']} | {row.get('kept after GiB', '-')} | "
                   f"{row['seconds']} |")
  return out + [""] + [source_line(src, sid) for sid, _, _ in CHECKPOINT_MEMORY]

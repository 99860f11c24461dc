#!/usr/bin/env python
"""Train a GPT-2 causal language model with Accelerate, in less memory with zoomem (logits never held).

    accelerate launch recipes/gpt2.py                                       # one process, the defaults below
    accelerate launch --multi_gpu --num_processes 2 recipes/gpt2.py         # DDP (gloo on a machine without GPU)
    accelerate launch --mixed_precision bf16 recipes/gpt2.py --zoomem auto --budget 60%
    accelerate launch recipes/gpt2.py --no-skip-logits                      # keep the logits, to compare
    accelerate launch recipes/gpt2.py --model gpt2 --dataset Salesforce/wikitext:wikitext-2-raw-v1   # the network

Defaults depend on the device. On CUDA: GPT-2's released layout (12 layers x 768, 12 heads) built from its config
with random weights, sequences of 128 tokens, batch 16, lr 3e-4. On CPU: a SHRUNK GPT-2 (4 layers x 256, 4 heads of
64 like GPT-2's), sequences of 32 tokens, batch 32, lr 1e-3, so that a default run ends in a few minutes on two
cores; the summary says which shape ran. --layers, --hidden-size, --heads and --seq-len override either. A Hub
checkpoint keeps its own shape (unless those flags are given) and fine-tunes at lr 5e-5.

Data: by default the WordNet glosses shipped with timm (zoomem.tasks' "text" task: 15182 train / 3797 test glosses,
its word-level vocabulary, offline), each gloss one sequence, padding ignored by the loss. With the network,
--dataset NAME[:CONFIG] loads a Hub dataset's first string column through `datasets` (empty lines dropped) and
tokenizes it with the model's tokenizer (--tokenizer for config-built models).

`--skip-logits` (the default with zoomem) wraps with ``skip_logits=True``: where the plan fuses the LM head with its
loss, the training forward returns ``logits=None`` and the vocabulary-sized logits are never held (their slices are
made again in backward), as Liger-Kernel's fused loss does; evaluation returns them as usual. The run ends with a
JSON summary (loss, eval loss and perplexity, samples/s, peak memory, zoomem's plan), printed and written to
<output-dir>/summary.json.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from typing import Any

_START = time.perf_counter()

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import zoomem.accelerate  # noqa: E402
from zoomem import recipes, tasks, zoo  # noqa: E402

logger = logging.getLogger("recipes.gpt2")

DEFAULTS = {  # per device type; None keeps the model id's own shape
    "cuda": {"layers": None, "hidden_size": None, "heads": None, "seq_len": 128, "batch_size": 16, "lr": 3e-4},
    "cpu": {"layers": 4, "hidden_size": 256, "heads": 4, "seq_len": 32, "batch_size": 32, "lr": 1e-3},
}
STEPS = 300
PRETRAINED_LR = 5e-5  # fine-tuning a Hub checkpoint
IGNORE = -100  # label of padding: the loss skips it


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model and data")
    m.add_argument("--model", default="hf/gpt2",
                   help="a zoomem zoo id built from its config with random weights (default hf/gpt2; no download), "
                        "or a Hub id / local path of a causal LM loaded with from_pretrained (e.g. gpt2; needs the "
                        "network)")
    m.add_argument("--layers", type=int, default=None, help="n_layer (CPU default 4)")
    m.add_argument("--hidden-size", type=int, default=None, help="n_embd (CPU default 256)")
    m.add_argument("--heads", type=int, default=None, help="n_head (CPU default 4)")
    m.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, padded (CUDA 128, CPU 32)")
    m.add_argument("--dataset", default="text",
                   help="'text' (default: the embedded WordNet-gloss task, offline) or a Hub dataset NAME[:CONFIG] "
                        "loaded with `datasets` (its first string column)")
    m.add_argument("--tokenizer", default="openai-community/gpt2",
                   help="tokenizer for Hub datasets when --model is a zoo id (a Hub checkpoint brings its own)")
    recipes.add_common_args(parser, steps=STEPS, lr=None, batch_size=None)
    parser.add_argument("--skip-logits", action=argparse.BooleanOptionalAction, default=True,
                        help="with zoomem: the training forward returns no logits where the plan fuses the LM head "
                             "with its loss (default on; --no-skip-logits keeps them)")
    return parser.parse_args()


def resolve_defaults(args: argparse.Namespace, device_type: str) -> None:
    """Fill the per-device defaults; a Hub checkpoint keeps its own shape and fine-tunes at a small lr."""
    recipes.fill_defaults(args, DEFAULTS["cuda" if device_type == "cuda" else "cpu"], args.model.startswith("hf/"),
                          PRETRAINED_LR, "out/gpt2")


# ---------------------------------------------------------------------------------------------- data


def load_data(args: argparse.Namespace, tokenizer: Any | None) -> tuple[TensorDataset, TensorDataset, dict[str, Any]]:
    """(train, test) as ``(input_ids, attention_mask, labels)`` of fixed length; labels are the ids with padding
    ignored (the model shifts them), and what the data is."""
    if args.dataset == "text":
        data = tasks.TASKS["text"].load()
        info: dict[str, Any] = {"name": "text", "source": f"WordNet 3.0 glosses of the ImageNet-22k synsets, "
                                f"{data.info['source']}"}
        if tokenizer is None:  # the task's own word-level ids (0 = padding)
            encoded = [recipes.fixed_length(x, args.seq_len) for x in (data.train_x, data.test_x)]
            encoded = [(ids, (ids != 0).long()) for ids in encoded]
            info["vocab_size"] = data.info["vocab_size"]
        else:  # a checkpoint's tokenizer reads the glosses themselves
            encoded = [recipes.tokenize(tokenizer, [data.info[k]], args.seq_len) for k in ("train_texts", "test_texts")]
    else:
        encoded, info = _hub_dataset(args, tokenizer)
    splits = [TensorDataset(ids, mask, ids.masked_fill(mask == 0, IGNORE)) for ids, mask in encoded]
    info.update(train=len(splits[0]), test=len(splits[1]),
                train_tokens=int(encoded[0][1].sum()), test_tokens=int(encoded[1][1].sum()))
    return splits[0], splits[1], info


def _hub_dataset(args: argparse.Namespace, tokenizer: Any) -> tuple[list, dict[str, Any]]:
    from datasets import load_dataset

    name, _, config = args.dataset.partition(":")
    ds = load_dataset(name, config or None)
    eval_split = next((s for s in ds if s.startswith("validation")), "test")
    column = next((c for c, f in ds["train"].features.items()
                   if getattr(f, "dtype", None) in ("string", "large_string")), None)
    if column is None:
        raise ValueError(f"--dataset {args.dataset}: expected a string column, found {dict(ds['train'].features)}.")
    if tokenizer.pad_token is None:  # GPT-2's tokenizer has none; padding is masked out of the loss anyway
        tokenizer.pad_token = tokenizer.eos_token
    encoded = [recipes.tokenize(tokenizer, [[t for t in ds[split][column] if t.strip()]], args.seq_len)
               for split in ("train", eval_split)]
    return encoded, {"name": args.dataset, "source": f"datasets.load_dataset({name!r}, {config or None!r}), "
                     f"eval split {eval_split!r}, text column {column!r}"}


# ---------------------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, vocab_size: int | None) -> torch.nn.Module:
    shape = {k: v for k, v in {"n_layer": args.layers, "n_embd": args.hidden_size, "n_head": args.heads}.items()
             if v is not None}
    if args.model.startswith("hf/"):  # from the config, random weights, nothing downloaded
        extra = {"vocab_size": vocab_size} if vocab_size else {}
        model, _ = zoo.build(args.model, n_positions=max(1024, args.seq_len), **shape, **extra)
        return model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", **shape)
    return model.train()  # from_pretrained returns eval mode; zoomem plans the mode it sees (a training step)


def evaluate(accelerator: Any, model: torch.nn.Module, loader: DataLoader) -> float:
    """Mean loss per predicted token on the whole test split, gathered over the processes."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for input_ids, attention_mask, labels in tqdm(loader, desc="eval", leave=False,
                                                      disable=not accelerator.is_local_main_process):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            targets = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                                     ignore_index=IGNORE, reduction="sum")
            total += torch.stack([loss.double(), (targets != IGNORE).sum().double()])
    model.train()
    total = accelerator.reduce(total, "sum")
    return float(total[0] / total[1].clamp(min=1))


def main() -> dict[str, Any]:
    args = parse_args()
    # cpu=True for a multi-process launch on a machine without GPU (gloo); fails if the process count is wrong
    accelerator = recipes.make_accelerator(args.expect_processes)
    recipes.setup_logging(accelerator)
    resolve_defaults(args, accelerator.device.type)
    from accelerate.utils import set_seed

    set_seed(args.seed)

    tokenizer = None
    if not args.model.startswith("hf/") or args.dataset != "text":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer if args.model.startswith("hf/") else args.model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    train_set, test_set, data_info = load_data(args, tokenizer)
    vocab = len(tokenizer) if tokenizer is not None else data_info.pop("vocab_size")
    model = build_model(args, vocab if args.model.startswith("hf/") else None)
    model.config.use_cache = False  # training: no key/value cache
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(args.seed))
    eval_set = recipes.eval_subset(test_set, args.max_eval_samples)
    eval_loader = DataLoader(eval_set, batch_size=args.eval_batch_size)

    skip_logits = args.skip_logits and args.zoomem != "off"
    if args.zoomem == "off":
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    else:
        # zoomem.accelerate.prepare checks the launch, lets Accelerate prepare, then wraps the module inside DDP
        # (instance forwards only) and plans on a first batch, under autocast.
        example = dict(zip(("input_ids", "attention_mask", "labels"),
                           (t[: args.batch_size] for t in train_set.tensors)))
        with accelerator.autocast():
            model, optimizer, train_loader, eval_loader = zoomem.accelerate.prepare(
                accelerator, model, optimizer, train_loader, eval_loader, batch=example, skip_logits=skip_logits,
                **recipes.wrap_options(args))
        zoomem.accelerate.log_plans(accelerator, model)
    steps = recipes.total_steps(args, STEPS, len(train_loader))
    scheduler = recipes.warmup_cosine(optimizer, steps)
    bare = accelerator.unwrap_model(model)
    cfg = bare.config
    global_batch = args.batch_size * accelerator.num_processes
    logger.info("training %s (%d layers x %d, %d heads, %.1fM parameters, vocabulary %d) for %d steps of %d x %d "
                "tokens on %d process(es), zoomem %s%s", args.model, cfg.n_layer, cfg.n_embd, cfg.n_head,
                sum(p.numel() for p in bare.parameters()) / 1e6, cfg.vocab_size, steps, global_batch, args.seq_len,
                accelerator.num_processes, args.zoomem, " without logits" if skip_logits else "")

    stats = recipes.StepStats(accelerator.device, args.meter_step)
    train_iter = recipes.batches(train_loader)
    progress = tqdm(range(steps), desc="train", disable=not accelerator.is_local_main_process)
    losses: dict[int, float] = {}
    logits_returned = None
    train_start = time.perf_counter()
    model.train()
    for step in progress:
        input_ids, attention_mask, labels = next(train_iter)
        with stats.step(step, global_batch, bare, optimizer, input_ids, attention_mask, labels):
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            stats.mark("forward")
            accelerator.backward(out.loss)
            stats.mark("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats.mark("optimizer")
        logits_returned = out.logits is not None
        loss = out.loss.detach()
        del out  # the logits, where returned, go before the next forward
        if not accelerator.optimizer_step_was_skipped:  # fp16 overflow steps do not advance the schedule
            scheduler.step()
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            mean = accelerator.reduce(loss, "mean").item()  # every process reaches this line
            losses[step + 1] = round(mean, 6)
            progress.set_postfix(loss=f"{mean:.4f}")
            logger.info("step %d/%d loss %.4f lr %.2e", step + 1, steps, mean, scheduler.get_last_lr()[0])
    train_seconds = time.perf_counter() - train_start
    eval_loss = evaluate(accelerator, model, eval_loader)
    logger.info("eval loss %.4f, perplexity %.1f", eval_loss, math.exp(min(eval_loss, 50.0)))

    summary = {
        "recipe": "gpt2",
        "model": {"id": args.model, "weights": "random (from config)" if args.model.startswith("hf/") else "pretrained",
                  "layers": cfg.n_layer, "hidden_size": cfg.n_embd, "heads": cfg.n_head, "vocab_size": cfg.vocab_size,
                  "seq_len": args.seq_len, "parameters": sum(p.numel() for p in bare.parameters())},
        "dataset": data_info, "eval_examples": len(eval_set),
        "steps": steps, "batch_size_per_process": args.batch_size, "global_batch_size": global_batch,
        "lr": args.lr, "seed": args.seed,
        "final_loss": losses[steps], "loss_log": losses,
        "eval_loss": round(eval_loss, 6), "eval_perplexity": round(math.exp(min(eval_loss, 50.0)), 3),
        "training_forward_returned_logits": logits_returned,
        "train_seconds": round(train_seconds, 2),
        **stats.summary(),
        "zoomem": {**recipes.plan_info(model, args), **({"skip_logits": skip_logits} if args.zoomem != "off" else {})},
    }
    summary["wall_seconds"] = round(time.perf_counter() - _START, 2)
    return recipes.finish(accelerator, summary, args.output_dir)


if __name__ == "__main__":
    main()

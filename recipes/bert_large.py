#!/usr/bin/env python
"""Train BERT-large for sequence classification with Accelerate, in less activation memory with zoomem.

    accelerate launch recipes/bert_large.py                                   # one process, the defaults below
    accelerate launch --multi_gpu --num_processes 2 recipes/bert_large.py     # DDP (gloo on a machine without GPU)
    accelerate launch --mixed_precision bf16 recipes/bert_large.py --zoomem auto --budget 60%
    accelerate launch recipes/bert_large.py --model bert-large-uncased --dataset glue/sst2   # needs the network

Defaults depend on the device. On CUDA: the full BERT-large layout (24 layers x 1024, 16 heads, MLP 4096) built
from its config with random weights, sequences of 128 tokens, batch 32, lr 1e-4. On CPU: a SHRUNK BERT-large
(4 layers x 256, 4 heads of 64 like BERT-large's, MLP 1024), sequences of 32 tokens, batch 32, lr 1e-3, so that a
default run ends in a few minutes on two cores; the summary says which shape ran. --layers, --hidden-size,
--heads, --intermediate-size and --seq-len override either. A Hub checkpoint keeps its own shape (unless those
flags are given) and fine-tunes at lr 2e-5. --budget defaults to 80% of plain PyTorch's peak.

Data: by default the WordNet glosses shipped with timm, labelled animal / artifact / person / plant (zoomem.tasks'
"text" task: 15182 train / 3797 test, word-level vocabulary, offline). With the network, --dataset NAME[:CONFIG]
loads a Hub dataset through `datasets` (glue/TASK is short for nyu-mll/glue:TASK) and tokenizes it with the
model's tokenizer (--tokenizer for config-built models).

`zoomem.accelerate.prepare` prepares, wraps and plans the model on a first batch; --zoomem off runs
plain PyTorch. The run ends with a JSON summary (loss, eval accuracy, samples/s, peak memory, zoomem's plan,
processes), printed and written to <output-dir>/summary.json.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

_START = time.perf_counter()

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import zoomem.accelerate  # noqa: E402
from zoomem import recipes, tasks, zoo  # noqa: E402

logger = logging.getLogger("recipes.bert_large")

DEFAULTS = {  # per device type; "layout" keeps the model id's own shape
    "cuda": {"layers": None, "hidden_size": None, "heads": None, "seq_len": 128, "batch_size": 32, "lr": 1e-4},
    "cpu": {"layers": 4, "hidden_size": 256, "heads": 4, "seq_len": 32, "batch_size": 32, "lr": 1e-3},
}
STEPS = 300
PRETRAINED_LR = 2e-5  # fine-tuning a Hub checkpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model and data")
    m.add_argument("--model", default="hf/bert-large-uncased",
                   help="a zoomem zoo id built from its config with random weights (default hf/bert-large-uncased; "
                        "no download), or a Hub id / local path loaded with from_pretrained (e.g. "
                        "bert-large-uncased; needs the network)")
    m.add_argument("--layers", type=int, default=None, help="num_hidden_layers (CPU default 4)")
    m.add_argument("--hidden-size", type=int, default=None, help="hidden_size (CPU default 256)")
    m.add_argument("--heads", type=int, default=None, help="num_attention_heads (CPU default 4)")
    m.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default 4 x hidden size)")
    m.add_argument("--seq-len", type=int, default=None, help="tokens per example, padded (CUDA 128, CPU 32)")
    m.add_argument("--dataset", default="text",
                   help="'text' (default: the embedded WordNet-gloss task, offline) or a Hub dataset NAME[:CONFIG] "
                        "loaded with `datasets` (glue/sst2 = nyu-mll/glue:sst2)")
    m.add_argument("--tokenizer", default="google-bert/bert-large-uncased",
                   help="tokenizer for Hub datasets when --model is a zoo id (a Hub checkpoint brings its own)")
    recipes.add_common_args(parser, steps=STEPS, lr=None, batch_size=None)
    return parser.parse_args()


def resolve_defaults(args: argparse.Namespace, device_type: str) -> None:
    """Fill the per-device defaults; a Hub checkpoint keeps its own shape and fine-tunes at a small lr."""
    from_config = args.model.startswith("hf/")
    recipes.fill_defaults(args, DEFAULTS["cuda" if device_type == "cuda" else "cpu"], from_config, PRETRAINED_LR,
                          "out/bert_large")
    if args.intermediate_size is None and args.hidden_size is not None and from_config:
        args.intermediate_size = 4 * args.hidden_size


# ---------------------------------------------------------------------------------------------- data


def load_data(args: argparse.Namespace, tokenizer: Any | None) -> tuple[TensorDataset, TensorDataset, dict[str, Any]]:
    """(train, test) as ``(input_ids, attention_mask, labels)`` tensors of fixed length, and what they are."""
    if args.dataset == "text":
        data = tasks.TASKS["text"].load()
        info = {"name": "text", "source": "WordNet 3.0 glosses of the ImageNet-22k synsets, "
                f"{data.info['source']}, labelled by WordNet category", "classes": list(tasks.TEXT_CATEGORIES)}
        if tokenizer is None:  # the task's own word-level ids (0 = padding)
            splits = [recipes.fixed_length(x, args.seq_len) for x in (data.train_x, data.test_x)]
            encoded = [(ids, (ids != 0).long()) for ids in splits]
            info["vocab_size"] = data.info["vocab_size"]
        else:  # a checkpoint's tokenizer reads the glosses themselves
            encoded = [recipes.tokenize(tokenizer, [data.info[k]], args.seq_len) for k in ("train_texts", "test_texts")]
        labels = [data.train_y, data.test_y]
    else:
        encoded, labels, info = _hub_dataset(args, tokenizer)
    train, test = (TensorDataset(ids, mask, y) for (ids, mask), y in zip(encoded, labels))
    counts = torch.bincount(labels[1])
    info.update(train=len(train), test=len(test), num_classes=int(max(len(counts), int(labels[0].max()) + 1)),
                majority_class_accuracy=round(100.0 * counts.max().item() / len(test), 2))
    return train, test, info


def _hub_dataset(args: argparse.Namespace, tokenizer: Any) -> tuple[list, list, dict[str, Any]]:
    from datasets import load_dataset

    name, _, config = args.dataset.partition(":")
    if name.startswith("glue/"):
        name, config = "nyu-mll/glue", name.split("/", 1)[1]
    ds = load_dataset(name, config or None)
    eval_split = next((s for s in ds if s.startswith("validation")), "test")
    train = ds["train"]
    columns = [c for c, f in train.features.items() if getattr(f, "dtype", None) in ("string", "large_string")][:2]
    if not columns or "label" not in train.features:
        raise ValueError(f"--dataset {args.dataset}: expected string column(s) and a 'label' column, found "
                         f"{dict(train.features)}.")
    encoded, labels = [], []
    for split in ("train", eval_split):
        part = ds[split]
        y = torch.tensor(list(part["label"]))
        if (y < 0).all():
            raise ValueError(f"--dataset {args.dataset}: split {split!r} has no labels (a hidden test set).")
        encoded.append(recipes.tokenize(tokenizer, [list(part[c]) for c in columns], args.seq_len))
        labels.append(y)
    classes = getattr(train.features["label"], "names", None)
    return encoded, labels, {"name": args.dataset, "source": f"datasets.load_dataset({name!r}, {config or None!r}), "
                            f"eval split {eval_split!r}, text columns {columns}", "classes": classes}


# ---------------------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, num_labels: int, vocab_size: int | None) -> torch.nn.Module:
    shape = {k: v for k, v in {"num_hidden_layers": args.layers, "hidden_size": args.hidden_size,
                               "num_attention_heads": args.heads, "intermediate_size": args.intermediate_size}.items()
             if v is not None}
    if args.model.startswith("hf/"):  # from the config, random weights, nothing downloaded
        extra = {"vocab_size": vocab_size} if vocab_size else {}
        model, _ = zoo.build(args.model, num_labels=num_labels, max_position_embeddings=max(512, args.seq_len),
                             **shape, **extra)
        return model
    from transformers import AutoModelForSequenceClassification

    # a new classification head when the checkpoint has none or another number of labels
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels,
                                                               ignore_mismatched_sizes=True,
                                                               attn_implementation="sdpa", **shape)
    return model.train()  # from_pretrained returns eval mode; zoomem plans the mode it sees (a training step)


def evaluate(accelerator: Any, model: torch.nn.Module, loader: DataLoader) -> tuple[float, int]:
    """Accuracy (percent) on the eval examples, gathered over the processes, and how many were counted (each once:
    ``gather_for_metrics`` drops the samples the last batches repeat to even out the processes)."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for input_ids, attention_mask, labels in tqdm(loader, desc="eval", leave=False,
                                                      disable=not accelerator.is_local_main_process):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            preds, labels = accelerator.gather_for_metrics((logits.argmax(-1), labels))
            correct += int((preds == labels).sum())
            total += labels.numel()
    model.train()
    return 100.0 * correct / max(total, 1), total


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
    train_set, test_set, data_info = load_data(args, tokenizer)
    vocab = len(tokenizer) if tokenizer is not None else data_info.pop("vocab_size")
    model = build_model(args, data_info["num_classes"], vocab if args.model.startswith("hf/") else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(args.seed))
    eval_set = recipes.eval_subset(test_set, args.max_eval_samples)
    eval_loader = DataLoader(eval_set, batch_size=args.eval_batch_size)

    if args.zoomem == "off":
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    else:
        # zoomem.accelerate.prepare checks the launch, lets Accelerate prepare, then wraps the module inside DDP
        # (instance forwards only: DDP's parameters and hooks stay) and plans on a first batch, under autocast.
        example = {"input_ids": train_set.tensors[0][: args.batch_size],
                   "attention_mask": train_set.tensors[1][: args.batch_size],
                   "labels": train_set.tensors[2][: args.batch_size]}
        with accelerator.autocast():
            model, optimizer, train_loader, eval_loader = zoomem.accelerate.prepare(
                accelerator, model, optimizer, train_loader, eval_loader, batch=example,
                **recipes.wrap_options(args))
        zoomem.accelerate.log_plans(accelerator, model)  # the plan's table, on the main process
    steps = recipes.total_steps(args, STEPS, len(train_loader))
    scheduler = recipes.warmup_cosine(optimizer, steps)  # stepped here, once per step (see warmup_cosine)
    bare = accelerator.unwrap_model(model)
    global_batch = args.batch_size * accelerator.num_processes
    logger.info("training %s (%d layers x %d, %d heads, %.1fM parameters) for %d steps of %d x %d tokens on %d "
                "process(es), zoomem %s", args.model, bare.config.num_hidden_layers, bare.config.hidden_size,
                bare.config.num_attention_heads, sum(p.numel() for p in bare.parameters()) / 1e6, steps,
                global_batch, args.seq_len, accelerator.num_processes, args.zoomem)

    stats = recipes.StepStats(accelerator.device, args.meter_step)
    train_iter = recipes.batches(train_loader)
    progress = tqdm(range(steps), desc="train", disable=not accelerator.is_local_main_process)
    losses: dict[int, float] = {}
    train_start = time.perf_counter()
    model.train()
    for step in progress:
        input_ids, attention_mask, labels = next(train_iter)
        with stats.step(step, global_batch, bare, optimizer, input_ids, attention_mask, labels):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            stats.mark("forward")
            accelerator.backward(loss)
            stats.mark("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats.mark("optimizer")
        if not accelerator.optimizer_step_was_skipped:  # fp16 overflow steps do not advance the schedule
            scheduler.step()
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            mean = accelerator.reduce(loss.detach(), "mean").item()  # every process reaches this line
            losses[step + 1] = round(mean, 6)
            progress.set_postfix(loss=f"{mean:.4f}")
            logger.info("step %d/%d loss %.4f lr %.2e", step + 1, steps, mean, scheduler.get_last_lr()[0])
    train_seconds = time.perf_counter() - train_start
    accuracy, evaluated = evaluate(accelerator, model, eval_loader)
    logger.info("eval accuracy %.2f%% (majority class %.2f%%)", accuracy, data_info["majority_class_accuracy"])

    cfg = bare.config
    summary = {
        "recipe": "bert_large",
        "model": {"id": args.model, "weights": "random (from config)" if args.model.startswith("hf/") else "pretrained",
                  "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, "seq_len": args.seq_len,
                  "parameters": sum(p.numel() for p in bare.parameters())},
        "dataset": data_info, "eval_examples": evaluated,
        "steps": steps, "batch_size_per_process": args.batch_size, "global_batch_size": global_batch,
        "lr": args.lr, "seed": args.seed,
        "final_loss": losses[steps], "loss_log": losses,
        "eval_accuracy": round(accuracy, 2),
        "train_seconds": round(train_seconds, 2),
        **stats.summary(),
        "zoomem": recipes.plan_info(model, args),
    }
    summary["wall_seconds"] = round(time.perf_counter() - _START, 2)
    return recipes.finish(accelerator, summary, args.output_dir)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Train a timm ResNet-50 image classifier with Accelerate, in less activation memory with zoomem.

    accelerate launch recipes/resnet50.py                                     # one process, the defaults below
    accelerate launch --multi_gpu --num_processes 2 recipes/resnet50.py       # DDP (gloo on a machine without GPU)
    accelerate launch recipes/resnet50.py --zoomem L2                         # GACT-style 4-bit compression
    accelerate launch recipes/resnet50.py --dataset uoft-cs/cifar10 --pretrained   # needs the network

Defaults: timm's resnet50 built with random weights (no download), SGD with Nesterov momentum, lr 0.1, batch 64,
100 steps, --zoomem lossless with a budget of 60% of plain PyTorch's peak on CUDA and 92% on CPU (at 32x32 the
activations are a small part of the step: weights, gradients and momentum are most of it), on scikit-learn's 8x8
handwritten digits (zoomem.tasks' "digits" task: 1198 train / 599 test, upscaled to 32x32x3, shifted by up to 2
pixels for augmentation, offline). Images are resized on the device to --image-size: 224 on CUDA (ResNet-50's own
resolution, where activation memory matters), 32 on CPU. --model takes any timm model name (resnet18 for quick
runs). With the network, --dataset NAME[:CONFIG] loads a Hub image classification dataset through `datasets`
(first Image and ClassLabel columns; a local image folder works too) with timm's transforms.

`zoomem.accelerate.prepare` prepares, wraps and plans the model on a first batch; --zoomem off runs
plain PyTorch. The run ends with a JSON summary (loss, eval accuracy, samples/s, peak memory, zoomem's plan,
processes), printed and written to <output-dir>/summary.json.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Callable

_START = time.perf_counter()

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import zoomem  # noqa: E402
import zoomem.accelerate  # noqa: E402
from zoomem import recipes, tasks, zoo  # noqa: E402

logger = logging.getLogger("recipes.resnet50")

IMAGE_SIZE = {"cuda": 224, "cpu": 32}
BUDGET = {"cuda": "60%", "cpu": "92%"}  # at 32x32 the step is mostly weights, gradients and momentum
STEPS, LR, BATCH = 100, 0.1, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model and data")
    m.add_argument("--model", default="resnet50", help="a timm model name (default resnet50)")
    m.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (needs the network)")
    m.add_argument("--image-size", type=int, default=None, help="height = width of the training images "
                   f"(CUDA {IMAGE_SIZE['cuda']}, CPU {IMAGE_SIZE['cpu']})")
    m.add_argument("--dataset", default="digits", help="'digits' (default: embedded, offline) or a Hub image "
                   "classification dataset NAME[:CONFIG] loaded with `datasets` (e.g. uoft-cs/cifar10)")
    m.add_argument("--workers", type=int, default=4, help="DataLoader workers for Hub datasets (decoding)")
    m.add_argument("--weight-decay", type=float, default=5e-4)
    recipes.add_common_args(parser, steps=STEPS, lr=LR, batch_size=BATCH,
                            budget=f"{BUDGET['cuda']} on CUDA, {BUDGET['cpu']} on CPU")
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------- data


def load_data(args: argparse.Namespace) -> tuple[Dataset, Dataset, dict[str, Any], dict[str, Any]]:
    """(train, test) datasets of ``(image, label)``, DataLoader options, and what the data is."""
    if args.dataset == "digits":
        data = tasks.TASKS["digits"].load()
        train, test = TensorDataset(data.train_x, data.train_y), TensorDataset(data.test_x, data.test_y)
        info = {"name": "digits", "source": data.info["source"], "num_classes": data.num_classes,
                "native_size": data.train_x.shape[-1], "augment": "shift by up to 2 pixels (zoomem.tasks)"}
        return train, test, {}, info
    from datasets import ClassLabel, Image, load_dataset
    from timm.data import create_transform

    name, _, config = args.dataset.partition(":")
    ds = load_dataset(name, config or None)
    eval_split = next((s for s in ("validation", "valid", "test", "val") if s in ds), None)
    if eval_split is None:
        raise ValueError(f"--dataset {args.dataset}: no validation/test split among {list(ds)}.")
    features = ds["train"].features
    image_col = next((c for c, f in features.items() if isinstance(f, Image)), None)
    label_col = next((c for c, f in features.items() if isinstance(f, ClassLabel)), None)
    if image_col is None or label_col is None:
        raise ValueError(f"--dataset {args.dataset}: expected an Image and a ClassLabel column, found "
                         f"{dict(features)}.")

    def collate(transform: Callable[[Any], torch.Tensor]) -> Callable[[list[dict]], tuple[torch.Tensor, torch.Tensor]]:
        def fn(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
            images = torch.stack([transform(r[image_col].convert("RGB")) for r in rows])
            return images, torch.tensor([r[label_col] for r in rows])
        return fn

    loader_kwargs = {"num_workers": args.workers,
                     "train_collate": collate(create_transform(args.image_size, is_training=True)),
                     "eval_collate": collate(create_transform(args.image_size))}
    info = {"name": args.dataset, "source": f"datasets.load_dataset({name!r}, {config or None!r}), eval split "
            f"{eval_split!r}", "num_classes": features[label_col].num_classes, "native_size": args.image_size,
            "augment": "timm create_transform(is_training=True)"}
    return ds["train"], ds[eval_split], loader_kwargs, info


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Images at ``size`` x ``size`` (bilinear, on the device): the embedded digits are 32x32."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)


def evaluate(accelerator: Any, model: torch.nn.Module, loader: DataLoader, size: int) -> float:
    """Accuracy (percent) on the whole test split, gathered over the processes."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in tqdm(loader, desc="eval", leave=False, disable=not accelerator.is_local_main_process):
            preds, labels = accelerator.gather_for_metrics((model(resize(images, size)).argmax(-1), labels))
            correct += int((preds == labels).sum())
            total += labels.numel()
    model.train()
    return 100.0 * correct / max(total, 1)


def main() -> dict[str, Any]:
    args = parse_args()
    # cpu=True for a multi-process launch on a machine without GPU (gloo); fails if the process count is wrong
    accelerator = recipes.make_accelerator(args.expect_processes)
    recipes.setup_logging(accelerator)
    device = "cuda" if accelerator.device.type == "cuda" else "cpu"
    args.image_size = args.image_size or IMAGE_SIZE[device]
    if args.budget is None and args.zoomem in ("lossless", "auto"):
        args.budget = BUDGET[device]
    args.output_dir = args.output_dir or Path("out/resnet50")
    from accelerate.utils import set_seed

    set_seed(args.seed)

    train_set, test_set, loader_kwargs, data_info = load_data(args)
    if args.pretrained:
        import timm

        model = timm.create_model(args.model, pretrained=True, num_classes=data_info["num_classes"])
    else:  # random weights, nothing downloaded
        model, _ = zoo.build(f"timm/{args.model}", num_classes=data_info["num_classes"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.weight_decay)
    train_collate, eval_collate = loader_kwargs.pop("train_collate", None), loader_kwargs.pop("eval_collate", None)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              collate_fn=train_collate, generator=torch.Generator().manual_seed(args.seed),
                              **loader_kwargs)
    eval_set = recipes.eval_subset(test_set, args.max_eval_samples)
    eval_loader = DataLoader(eval_set, batch_size=args.eval_batch_size, collate_fn=eval_collate, **loader_kwargs)
    augment = tasks.TASKS["digits"].augment if args.dataset == "digits" else None
    augment_gen = torch.Generator().manual_seed(args.seed + accelerator.process_index)

    if args.zoomem == "off":
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    else:
        # zoomem.accelerate.prepare checks the launch, lets Accelerate prepare, then wraps the module inside DDP
        # (instance forwards only: DDP's parameters and hooks stay) and plans on a first batch, under autocast.
        images, labels = (train_loader.collate_fn or torch.utils.data.default_collate)(
            [train_set[i] for i in range(args.batch_size)])
        example = zoomem.Batch(args=(resize(images, args.image_size),), target=labels)  # loss: cross-entropy
        with accelerator.autocast():
            model, optimizer, train_loader, eval_loader = zoomem.accelerate.prepare(
                accelerator, model, optimizer, train_loader, eval_loader, batch=example,
                **recipes.wrap_options(args))
        zoomem.accelerate.log_plans(accelerator, model)  # the plan's table, on the main process
    steps = recipes.total_steps(args, STEPS, len(train_loader))
    scheduler = recipes.warmup_cosine(optimizer, steps)  # stepped here, once per step (see warmup_cosine)
    bare = accelerator.unwrap_model(model)
    global_batch = args.batch_size * accelerator.num_processes
    logger.info("training timm %s (%.1fM parameters) for %d steps of %d images at %dx%d on %d process(es), zoomem %s",
                args.model, sum(p.numel() for p in bare.parameters()) / 1e6, steps, global_batch, args.image_size,
                args.image_size, accelerator.num_processes, args.zoomem)

    stats = recipes.StepStats(accelerator.device, args.meter_step)
    train_iter = recipes.batches(train_loader)
    progress = tqdm(range(steps), desc="train", disable=not accelerator.is_local_main_process)
    losses: dict[int, float] = {}
    train_start = time.perf_counter()
    model.train()
    for step in progress:
        images, labels = next(train_iter)
        if augment is not None:
            images = augment(images, augment_gen)
        images = resize(images, args.image_size)
        with stats.step(step, global_batch, bare, optimizer, images, labels):
            loss = F.cross_entropy(model(images), labels)
            stats.mark("forward")
            accelerator.backward(loss)
            stats.mark("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats.mark("optimizer")
        if not accelerator.optimizer_step_was_skipped:  # fp16 overflow steps do not advance the schedule
            scheduler.step()
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            mean = accelerator.reduce(loss.detach().float(), "mean").item()  # every process reaches this line
            losses[step + 1] = round(mean, 6)
            progress.set_postfix(loss=f"{mean:.4f}")
            logger.info("step %d/%d loss %.4f lr %.2e", step + 1, steps, mean, scheduler.get_last_lr()[0])
    train_seconds = time.perf_counter() - train_start
    accuracy = evaluate(accelerator, model, eval_loader, args.image_size)
    logger.info("eval accuracy %.2f%%", accuracy)

    summary = {
        "recipe": "resnet50",
        "model": {"id": f"timm/{args.model}", "weights": "pretrained" if args.pretrained else "random",
                  "image_size": args.image_size, "parameters": sum(p.numel() for p in bare.parameters())},
        "dataset": {**data_info, "train": len(train_set), "test": len(test_set)}, "eval_examples": len(eval_set),
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

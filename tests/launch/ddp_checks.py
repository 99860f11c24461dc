"""Started by tests/test_accelerate.py through ``accelerate launch``; every rank writes ``<out>/<mode>-rank<r>.json``.

Modes:

- ``count --expect N``: only :func:`zoomem.accelerate.check_processes` (a launch that gave other processes raises).
- ``train``: the DDP checks in one launch (process start-up and imports are most of the cost), each section on a
  fresh ``Accelerator`` and a fresh model: a lossless budget against plain Accelerate (parameters after three
  steps), compression bits and sensitivities per rank, bf16 with gradient accumulation and clipping, the HF
  Trainer with and without ``ZoomemCallback``, ranks meeting inputs of different shapes (:data:`SHAPES`), and
  ``save_state`` after ``K`` steps followed by two more steps.
- ``resume``: a fresh launch that ``load_state``s that checkpoint and runs the same two steps.
- ``infeasible``: rank 1 meets a batch that no plan fits under a byte budget that rank 0's batch fits
  (:func:`infeasible`): rank 1 raises, and rank 0, waiting in DDP's all-reduce, fails as its peer goes.

Each rank trains on its own batches (seeded by step and rank), so parameters stay equal across ranks only if DDP
synchronises the gradients.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import zoomem
import zoomem.accelerate as za
from zoomem.runtime.distributed import bucket_bytes
from zoomem.zoo import build

BERT = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000,
            max_position_embeddings=64)
BATCH, SEQ = 8, 64
K = 2  # steps before save_state
LOSSLESS = 0.635  # of plain PyTorch's peak: only plans that recompute a layer fit (keeping both with their compact
# forms needs 0.77, recomputing one without them 0.66: both must stay out, or timing noise picks between them)
AUTO = 0.575  # below the lossless minimum (0.585; combined 0.565): only plans storing some tensor in fewer bits fit
# (at 0.6 the combined program, which offers every lossless mode too, may keep both layers compact and exact)
# (these shares count DDP's gradient buckets, 0.53 MiB of the 9.20 MiB plain peak, in the peak and the budget: each
# plan's peak is that much higher than before they counted, when the shares were 0.62 / 0.76 / 0.64 / 0.55 / 0.558)
LOSSLESS_BF16 = 0.8  # under bf16 autocast the attention runs as it is (zoomem's keeps fp32 only): 0.62 does not fit


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same tiny BERT (dropout on) and AdamW every time, the caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, _ = build("hf/bert-base-uncased", **BERT)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[:, SEQ - 1 - step % 4:] = 0  # some padding
    return {
        "input_ids": torch.randint(0, BERT["vocab_size"], (BATCH, SEQ), generator=g),
        "attention_mask": mask,
        "labels": torch.randint(0, 2, (BATCH,), generator=g),
    }


class Rows(torch.utils.data.Dataset):
    """``n`` single examples for the HF Trainer (its collator stacks them into batches); ``varied``: rows of 40 to
    64 tokens, unpadded, for a collator that pads each batch to its longest row."""

    def __init__(self, n: int = 48, varied: bool = False) -> None:
        g = torch.Generator().manual_seed(99)
        ids = torch.randint(0, BERT["vocab_size"], (n, SEQ), generator=g)
        labels = torch.randint(0, 2, (n,), generator=g)
        mask = (torch.arange(SEQ) < SEQ - torch.arange(n)[:, None] % 4).long()
        lengths = [40 + (7 * i) % 25 if varied else SEQ for i in range(n)]
        self.rows = [{"input_ids": ids[i, :n], "labels": labels[i],
                      "attention_mask": torch.ones(n, dtype=torch.long) if varied else mask[i, :n]}
                     for i, n in enumerate(lengths)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


PADDED: list[int] = []
"""The lengths :func:`pad_to_longest` padded batches to, in order."""


def pad_to_longest(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as the Trainer's default ``DataCollatorWithPadding`` does: each batch to its longest row."""
    n = max(len(r["input_ids"]) for r in rows)
    PADDED.append(n)
    pad = lambda t: torch.nn.functional.pad(t, (0, n - len(t)))  # noqa: E731
    return {"input_ids": torch.stack([pad(r["input_ids"]) for r in rows]),
            "attention_mask": torch.stack([pad(r["attention_mask"]) for r in rows]),
            "labels": torch.stack([r["labels"] for r in rows])}


def run_trainer(out_dir: Path, callback: Any = None, max_steps: int = 3, dynamic: bool = False, **args: Any) -> Any:
    """A few Trainer steps on the tiny BERT (CPU, no reports, no checkpoints); returns the Trainer. ``dynamic``:
    rows of several lengths, each batch padded to its longest (:func:`pad_to_longest`)."""
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state()
    GradientState._reset_state()
    model, _ = model_and_opt()
    targs = TrainingArguments(
        output_dir=str(out_dir), use_cpu=True, report_to=[], max_steps=max_steps, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, **args,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(varied=dynamic),
                      data_collator=pad_to_longest if dynamic else None, callbacks=[callback] if callback else None)
    trainer.train()
    return trainer


def fresh_accelerator(mixed_precision: str = "no", **kwargs: Any) -> Accelerator:
    """A new Accelerator with new settings in the same process (the process group stays)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(mixed_precision=mixed_precision, **kwargs)


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


def grads(model: torch.nn.Module) -> torch.Tensor:
    return flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters())


def setup(acc: Accelerator, how: str, **zoomem_kwargs: Any) -> tuple[Any, Any]:
    """``plain``: Accelerate alone; ``before``: zoomem.wrap, then prepare; ``helper``: zoomem.accelerate.prepare."""
    model, opt = model_and_opt()
    if how == "before":
        zoomem.wrap(model, optimizer=opt, **zoomem_kwargs)
    if how == "helper":
        return za.prepare(acc, model, opt, expect_processes=2, **zoomem_kwargs)
    return acc.prepare(model, opt)


def plan_info(model: torch.nn.Module) -> dict[str, Any]:
    """The first plan's decisions, bits and sensitivities, and every plan's signature (under gradient
    accumulation a micro-batch that starts with the gradients held plans apart)."""
    plans = za.plans(model)
    plan = plans[0]
    return {
        "signatures": [p.signature for p in plans],
        "ddp_bytes": plan.ddp_bytes,  # DDP's gradient buckets, counted in the plan's fixed bytes
        "bucket_bytes": bucket_bytes(model),
        "decisions": [u.decision.value + (" + compact" if u.compact else "") for u in plan.units],
        "bits": plan.bits,
        "sensitivity": {d["key"]: d.get("sensitivity") for d in plan.saved},
    }


def steps(acc: Accelerator, model: Any, opt: Any, which: range) -> list[float]:
    losses = []
    for step in which:
        loss = model(**batch(step, acc.process_index)).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def lossless(out: dict[str, Any]) -> None:
    """Three DDP steps plain, wrapped before prepare, and through the helper: parameters equal to plain's."""
    params = {}
    for how in ("plain", "before", "helper"):
        acc = fresh_accelerator()
        model, opt = setup(acc, how, **({} if how == "plain" else {"budget": LOSSLESS}))
        torch.manual_seed(1234 + acc.process_index)  # the same dropout masks in every run
        out[f"lossless_{how}_losses"] = steps(acc, model, opt, range(3))
        params[how] = flat(model.parameters())
        if how != "plain":
            out[f"lossless_{how}_plan"] = plan_info(model)
            out[f"lossless_{how}_max_param_diff"] = (params[how] - params["plain"]).abs().max().item()
    out["is_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    out["distributed_type"] = str(acc.distributed_type.value)
    out["num_processes"] = acc.num_processes
    out["lossless_param_checksum"] = params["helper"].sum().item()  # compared across ranks


def compress(out: dict[str, Any]) -> None:
    """Adaptive bits (L2, sensitivities measured again after 2 steps) and the ILP's bits under a budget."""
    for name, kw in (("L2", {"level": "L2", "sensitivity_interval": 2}),
                     ("auto", {"budget": AUTO, "compress": "auto"})):
        acc = fresh_accelerator()
        model, opt = setup(acc, "helper", **kw)
        torch.manual_seed(1234 + acc.process_index)
        losses = steps(acc, model, opt, range(3))
        out[f"compress_{name}"] = {**plan_info(model), "losses": losses,
                                   "param_checksum": flat(model.parameters()).sum().item()}


def bf16(out: dict[str, Any]) -> None:
    """bf16 autocast, 2-step gradient accumulation (no_sync on the first) and clip_grad_norm_, plain, with a
    lossless budget and with L2: losses finite, synced gradients and clipped norms close to plain's."""
    runs = {}
    for name, kw in (("plain", None), ("lossless", {"budget": LOSSLESS_BF16}), ("L2", {"level": "L2"})):
        acc = fresh_accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
        model, opt = setup(acc, "plain" if kw is None else "helper", **(kw or {}))
        torch.manual_seed(1234 + acc.process_index)
        losses, norms, synced = [], [], []
        for step in range(4):
            with acc.accumulate(model):
                loss = model(**batch(step, acc.process_index)).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    synced.append(grads(model))
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs[name] = synced
        out[f"bf16_{name}"] = {
            "losses": losses, "norms": norms,
            "grads_finite": all(bool(torch.isfinite(g).all()) for g in synced),
            "grad_rel_diff": [((g - r).norm() / r.norm()).item() for g, r in zip(synced, runs["plain"])],
            "autocast_after": torch.is_autocast_enabled("cpu"),
            **({"plan": plan_info(model)} if kw else {}),
        }


def trainer(out: dict[str, Any], out_dir: Path) -> None:
    """The HF Trainer under DDP with dynamic padding (each rank's batches padded to their longest row), plain and
    with ZoomemCallback (a recomputing budget): the same losses and parameters; the callback wraps the module the
    Trainer's DDP container holds, and each rank plans for the lengths it meets."""
    from zoomem.hf_trainer import ZoomemCallback

    plain = run_trainer(out_dir, dynamic=True)
    cb = ZoomemCallback(LOSSLESS, expect_processes=2)
    PADDED.clear()
    wrapped = run_trainer(out_dir, cb, dynamic=True)
    out["trainer_lengths"] = list(PADDED)
    for name, t in (("plain", plain), ("zoomem", wrapped)):
        out[f"trainer_{name}"] = {
            "losses": [h["loss"] for h in t.state.log_history if "loss" in h],
            "param_checksum": flat(t.model.parameters()).sum().item(),
            "container": type(t.model_wrapped).__name__,
        }
    out["trainer_zoomem"]["decisions"] = [u.decision.value for u in cb.plans[0].units]
    out["trainer_zoomem"]["ddp_bytes"] = cb.plans[0].ddp_bytes
    out["trainer_zoomem"]["bucket_bytes"] = bucket_bytes(wrapped.model_wrapped)
    out["trainer_zoomem"]["unwrapped_after"] = not zoomem.is_wrapped(wrapped.model)
    out["trainer_max_param_diff"] = (flat(plain.model.parameters()) - flat(wrapped.model.parameters())).abs().max().item()


def save(out: dict[str, Any], ckpt: Path) -> None:
    """K steps, save_state, two more steps: their losses are what ``resume`` must reproduce."""
    acc = fresh_accelerator()
    model, opt = setup(acc, "helper", budget=LOSSLESS)
    torch.manual_seed(1234 + acc.process_index)
    steps(acc, model, opt, range(K))
    acc.save_state(str(ckpt))
    out["saved_param_checksum"] = flat(model.parameters()).sum().item()
    out["after_save_losses"] = steps(acc, model, opt, range(K, K + 2))
    out["state_dict_keys"] = sorted(acc.unwrap_model(model).state_dict())
    out["plain_keys"] = sorted(model_and_opt()[0].state_dict())
    if acc.is_main_process:
        from safetensors.torch import load_file

        out["saved_keys"] = sorted(load_file(str(ckpt / "model.safetensors")))


def resume(out: dict[str, Any], ckpt: Path) -> None:
    acc = fresh_accelerator()
    model, opt = setup(acc, "helper", budget=LOSSLESS)
    acc.load_state(str(ckpt))
    out["loaded_param_checksum"] = flat(model.parameters()).sum().item()
    out["resumed_losses"] = steps(acc, model, opt, range(K, K + 2))
    out["resume_plan"] = plan_info(model)


SHAPES = ((64, 56), (64, 60), (48, 40))
"""Per step, rank 0's and rank 1's sequence lengths: dynamic padding, where at step 1 only rank 1 meets a length it
has no plan for, and at step 2 both meet lengths no larger than planned ones."""


LOSSY_SHAPES = (((BATCH, BATCH), (48, 56)), ((BATCH, BATCH), (64, 64)), ((BATCH, BATCH), (60, 40)),
                ((BATCH, BATCH), (56, 52)), ((BATCH, BATCH // 2), (40, 64)))
"""Per step under ``L2``, (rank 0's and rank 1's rows, their lengths): rank 1's inputs hold rank 0's and it plans
for both alone; one shape, planned together; a length no plan has, under the longer one's plan; the plan made at
step 0 again; and inputs neither of which holds the other's (fewer rows, longer ones), which every rank refuses."""


def cut(step: int, rank: int, length: int) -> dict[str, torch.Tensor]:
    """:func:`batch` with its sequences cut to ``length`` tokens."""
    return {k: v[:, :length] if v.dim() == 2 else v for k, v in batch(step, rank).items()}


def shapes(out: dict[str, Any]) -> None:
    """Dynamic padding under DDP. Lossless: each rank plans for its own inputs when it meets them (rank 1 alone at
    step 1, with no collective for rank 0 to wait in) and reuses a larger length's plan; the DDP steps give plain
    Accelerate's losses and parameters. Lossy (L2, bits shared by every rank, :data:`LOSSY_SHAPES`): every rank
    runs the plan of the largest inputs, which the rank that has them makes alone where none is cached; inputs
    neither of which holds the other's raise on every rank."""
    params = {}
    for how in ("plain", "helper"):
        acc = fresh_accelerator()
        model, opt = setup(acc, how, **({} if how == "plain" else {"budget": LOSSLESS}))
        torch.manual_seed(1234 + acc.process_index)  # the same dropout masks in both runs
        losses = []
        for step, lengths in enumerate(SHAPES):
            loss = model(**cut(step, acc.process_index, lengths[acc.process_index])).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[f"shapes_{how}_losses"] = losses
        params[how] = flat(model.parameters())
    out["shapes_max_param_diff"] = (params["helper"] - params["plain"]).abs().max().item()
    out["shapes_param_checksum"] = params["helper"].sum().item()  # compared across ranks
    out["shapes_plans"] = [p.signature for p in za.plans(model)]
    acc = fresh_accelerator()
    model, opt = setup(acc, "helper", level="L2")
    handle = za._bare(model).__dict__["_zoomem"]
    active_for, ran = handle.active_for, []

    def recording(plan: Any, smaller: bool = False) -> Any:
        ran.append((sorted(plan.bits.items()), smaller))
        return active_for(plan, smaller)

    handle.active_for = recording
    out["shapes_lossy_error"], out["shapes_lossy_ran"] = None, []
    for step, (rows, lengths) in enumerate(LOSSY_SHAPES):
        try:
            kwargs = {k: v[:rows[acc.process_index]] for k, v in cut(step, acc.process_index,
                                                                      lengths[acc.process_index]).items()}
            loss = model(**kwargs).loss
        except RuntimeError as exc:
            out["shapes_lossy_error"], out["shapes_lossy_step"] = str(exc), step
            break
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["shapes_lossy_ran"].append(ran[-1])
    out["shapes_lossy_param_checksum"] = flat(model.parameters()).sum().item()
    torch.distributed.barrier()


SHORT = 16
"""Rank 0's sequence length in :func:`infeasible` (rank 1's is :data:`SEQ`)."""


def infeasible(out: dict[str, Any]) -> None:
    """A byte budget 1.4 times plain PyTorch's peak for rank 0's short batch (3.0 MiB; under DDP, with its gradient
    buckets, rank 0 needs 3.3): rank 0 plans within it, rank 1's full-length batch has no plan that fits (5.4 MiB
    at least) and its forward raises, naming the smallest budget that works. Nothing lets rank 0 know (lossless
    plans are per rank, with no collective): it waits in DDP's all-reduce until rank 1's exit closes their
    connection (gloo raises) or the launcher stops it. Neither rank writes its JSON."""
    model, opt = model_and_opt()
    short = zoomem.Batch(kwargs=cut(0, 0, SHORT))
    budget = int(1.4 * zoomem.plan(model, short, optimizer=opt).baseline_peak_bytes)
    acc = fresh_accelerator()
    model, opt = setup(acc, "helper", budget=budget)
    print(f"zoomem launch check infeasible: rank {acc.process_index} plans under {budget} bytes", file=sys.stderr)
    loss = model(**cut(0, acc.process_index, SEQ if acc.process_index else SHORT)).loss
    acc.backward(loss)
    opt.step()
    out["infeasible_trained"] = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["count", "train", "resume", "infeasible"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--expect", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("zoomem").setLevel(logging.INFO)  # the test reads the re-measurement lines
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    acc = Accelerator()
    out["num_processes"] = za.check_processes(acc, args.expect)
    if args.mode == "train":
        lossless(out)
        shapes(out)
        compress(out)
        bf16(out)
        trainer(out, args.out / "trainer")
        save(out, args.out / "ckpt")
    elif args.mode == "resume":
        resume(out, args.out / "ckpt")
    elif args.mode == "infeasible":
        infeasible(out)
    rank = int(os.environ.get("RANK", "0"))
    (args.out / f"{args.mode}-rank{rank}.json").write_text(json.dumps(out))
    # every rank leaves the gloo group together, as zoomem.recipes.finish does: a group still alive at interpreter
    # exit can abort a rank ("terminate called without an active exception") after its checks passed
    acc.wait_for_everyone()
    acc.end_training()
    print(f"zoomem launch check {args.mode}: rank {rank} done", file=sys.stderr)


if __name__ == "__main__":
    main()

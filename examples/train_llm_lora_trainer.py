"""LoRA fine-tuning of a causal language model with transformers' ``Trainer``, under a GPU
memory budget.

The pattern: build the model (on the CPU: it need not fit the GPU), add the peft LoRA, then
``vramkit.fit`` it *before* the Trainer sees it -- the plan swaps and checkpoints blocks for
``--vram_budget`` and puts the rest on the GPU -- and hand the fitted model to the Trainer as
usual. Two things the Trainer would otherwise do are left to the plan: its own gradient
checkpointing (``gradient_checkpointing=False``: the plan checkpoints the blocks that need it)
and moving the model (already placed; a ``.to(device)`` of a fitted model changes nothing).
:class:`FitCallback` prints the plan when training starts, compares it with the measured steps
and gives the model back (``fitted.detach()``) when training ends, with the adapters trained.

    python examples/train_llm_lora_trainer.py --model /tmp/tiny/llama \\
        --train_file /tmp/tiny/llama/train.txt --output_dir /tmp/llm-lora --max_steps 4 \\
        --seq_len 64 --vram_budget 2200KiB --cpu

The model folder holds a transformers config and weights; with no tokenizer files in it, text
is tokenized as UTF-8 bytes (ids 0-255; the vocabulary must have at least 256 entries).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import vramkit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Causal LM LoRA fine-tuning with transformers' "
                                            "Trainer, fitted to a GPU budget by vramkit.")
    p.add_argument("--model", required=True, help="local transformers model folder")
    p.add_argument("--train_file", required=True, help="a text file, one example per line")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seq_len", type=int, default=128, help="tokens per example (padded)")
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=100)
    p.add_argument("--learning_rate", type=float, default=2e-4)
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--lora_target_modules", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    p.add_argument("--save_steps", type=int, default=500)
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="a checkpoint-N folder of --output_dir, or 'latest'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true",
                   help="train on the CPU even when a GPU is visible (smoke tests)")
    p.add_argument("--vram_budget", default="12GiB",
                   help="GPU memory the training step may use (vramkit.fit)")
    p.add_argument("--hardware", default=None,
                   help="plan for a named GPU instead of measuring this one")
    p.add_argument("--host_memory", choices=("auto", "pinned", "pageable"), default="auto",
                   help="where swapped weights live on the host (vramkit.fit's host_memory)")
    return p.parse_args(argv)


class ByteTokenizer:
    """UTF-8 bytes as token ids, for model folders without tokenizer files."""

    pad_token_id = 0

    def __call__(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def tokenizer_for(folder: str) -> Any:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return ByteTokenizer()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def encode(text: str) -> list[int]:
        return list(tok(text)["input_ids"])

    encode.pad_token_id = tok.pad_token_id  # type: ignore[attr-defined]
    return encode


class TextDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each line as ``seq_len`` tokens (cut or padded), labels masked on the padding. No
    attention mask: padding comes after the text, which causal attention never lets the text
    see."""

    def __init__(self, path: str, tokenize: Any, seq_len: int) -> None:
        self.rows = []
        pad = tokenize.pad_token_id
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            ids = tokenize(line)[:seq_len]
            labels = ids + [-100] * (seq_len - len(ids))
            ids = ids + [pad] * (seq_len - len(ids))
            self.rows.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)})
        if not self.rows:
            raise SystemExit(f"{path} holds no text")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def fit_callback_class() -> type:
    from transformers import TrainerCallback

    class FitCallback(TrainerCallback):  # type: ignore[misc]
        """Shows the plan at the start, the measured steps against it at the end, and gives
        the model back when training ends (``fitted.detach()``: trained adapters kept)."""

        def __init__(self, fitted: vramkit.Fitted) -> None:
            self.fitted = fitted

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.is_world_process_zero:
                print(self.fitted.plan.explain())

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            report = self.fitted.report()
            if state.is_world_process_zero and report.steps:
                print(report.describe())

    return FitCallback


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, set_seed

    set_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, task_type="CAUSAL_LM",
        target_modules=[m.strip() for m in args.lora_target_modules.split(",")]))
    dataset = TextDataset(args.train_file, tokenizer_for(args.model), args.seq_len)

    # Fit before the Trainer wraps anything: a batch of the size trained is what it plans for.
    batch = {k: torch.stack([dataset[i][k] for i in range(min(len(dataset),
                                                               args.per_device_train_batch_size))])
             .to(device) for k in ("input_ids", "labels")}
    fitted = vramkit.fit(model, batch, args.vram_budget, device=device, hardware=args.hardware,
                         autocast=torch.bfloat16 if args.bf16 else None,
                         host_memory=args.host_memory)

    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.max_steps,
        learning_rate=args.learning_rate, bf16=args.bf16, save_steps=args.save_steps,
        logging_steps=1, report_to=[], seed=args.seed, use_cpu=device.type == "cpu",
        dataloader_pin_memory=False)  # no Trainer checkpointing: the plan checkpoints blocks
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                      callbacks=[fit_callback_class()(fitted)])
    resume = args.resume_from_checkpoint
    result = trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    fitted.detach()  # the model as it was (on the CPU), adapters trained
    model.save_pretrained(args.output_dir)  # the adapter only (peft)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(f"trained {result.global_step} steps, last loss {losses[-1]:.4f}; adapter in "
          f"{args.output_dir}")
    return {"global_step": result.global_step, "losses": losses, "plan": fitted.plan}


if __name__ == "__main__":
    main()

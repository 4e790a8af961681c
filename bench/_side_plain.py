"""Side (a): a hand-written PyTorch loop, doing what the trainers do per step and nothing more.

Same data, model, collator, batch size, fused AdamW, linear schedule (no warmup), gradient clipping at 1.0
and loss logging every 50 steps as the trainer sides.
"""

import sys

import torch
from _common import (
    LOGGING_STEPS,
    SEED,
    Recorder,
    build_dataset,
    build_model,
    collate,
    linear_schedule,
    load_config,
)


def main() -> None:
    cfg = load_config(sys.argv)
    rec = Recorder()
    dataset = build_dataset(cfg)
    model = build_model(cfg)
    generator = torch.Generator().manual_seed(SEED)
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                                         collate_fn=collate, num_workers=0, generator=generator)
    total_steps = len(loader) * cfg["epochs"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)
    scheduler = linear_schedule(optimizer, total_steps)

    rec.mark("train_begin")
    model.train()
    step, running, total = 0, torch.zeros(()), 0.0
    for _epoch in range(cfg["epochs"]):
        for batch in loader:
            loss = model(**batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            rec.mark_optimizer_step()
            scheduler.step()
            model.zero_grad(set_to_none=True)
            running += loss.detach()
            step += 1
            rec.mark_step_end()
            if step % LOGGING_STEPS == 0:
                value = running.item()
                total += value
                rec.logs.append({"loss": round(value / LOGGING_STEPS, 4), "step": step})
                running.zero_()
    total += running.item()
    rec.logs.append({"train_loss": total / step})
    rec.write(1, cfg["batch_size"], global_step=step)


if __name__ == "__main__":
    main()

"""Side (a): a hand-written PyTorch loop, doing what the trainers do per step and nothing more.

Same data, model, collator, batch size, fused AdamW, linear schedule (no warmup), gradient clipping at 1.0
and loss logging every 50 steps as the trainer sides.
"""

import sys

from _common import LOGGING_STEPS, Recorder, hand_loop, load_config


def main() -> None:
    cfg = load_config(sys.argv)
    rec = Recorder()
    _model, step, sums, rest = hand_loop(cfg, rec)
    total = 0.0
    for at, value in sums:
        total += value
        rec.logs.append({"loss": round(value / LOGGING_STEPS, 4), "step": at})
    total += rest
    rec.logs.append({"train_loss": total / step})
    rec.write(1, cfg["batch_size"], global_step=step)


if __name__ == "__main__":
    main()

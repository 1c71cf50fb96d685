#!/usr/bin/env python3
"""SpecForge TRAINING STAND-IN: trains nothing, needs no GPU, no model, no torch.

This is NOT SpecForge.  It exists so `remote-ops train start|status|stop` and
`logs summary` can be exercised end to end in the sandbox and the tests.  It
writes, at a steady pace:

- log lines in the formats remote-ops parses (`remote_ops/logs.py`): the tqdm bar
  `Training Epoch E:  p%|...| n/N [elapsed<remaining, r it/s, loss=.., acc=..]`
  and the per-epoch summary `Train Epoch [e/E], position i,  Acc: ..` / `pLoss: ..`
  of SpecForge's train_eagle3 scripts.  Every value is SYNTHETIC (a fixed curve);
  the first line of the log says so;
- checkpoint folders named as SpecForge 0.2.0's CheckpointManager names them,
  `<output>/<run_id>-step<N>`, plus the `<run_id>-latest` link, each holding a
  `STANDIN.txt` and a `config.json` with `"standin": true` - no weights.

Stops cleanly on SIGTERM (logs `stopped`).  Standard library only.
"""
import argparse
import json
import math
import os
import signal
import sys
import time

BANNER = ("SPECFORGE STAND-IN (remote-ops): no model, no GPU, nothing is trained; "
          "every accuracy and loss below is synthetic")
STOP = {"flag": False}


def synthetic_acc(epoch, step_frac, position):
    """A fixed learning curve: position 0 rises towards ~0.74, later positions lower."""
    progress = epoch + step_frac
    return round(0.74 * (0.88 ** position) * (1 - math.exp(-(progress + 0.3) / 1.5)), 4)


def synthetic_ploss(epoch, step_frac, position):
    return round(2.5 * (1.1 ** position) * math.exp(-(epoch + step_frac) / 3.0) + 0.4, 4)


def clock(seconds):
    seconds = int(seconds)
    return "%02d:%02d" % (seconds // 60, seconds % 60)


def log(fh, text, end="\n"):
    fh.write(text + end)
    fh.flush()


def tqdm_line(epoch, n, total, elapsed, step_s, positions):
    pct = int(100 * n / total)
    bar = "#" * (pct // 10) + " " * (10 - pct // 10)
    accs = [synthetic_acc(epoch, n / total, i) for i in range(positions)]
    losses = [synthetic_ploss(epoch, n / total, i) for i in range(positions)]
    loss = sum(0.8 ** i * v for i, v in enumerate(losses)) / positions
    return ("Training Epoch %d: %3d%%|%s| %d/%d [%s<%s, %.2fit/s, loss=%.4f, acc=%.4f, time=%.2fs]"
            % (epoch, pct, bar, n, total, clock(elapsed), clock((total - n) * step_s), 1 / step_s,
               loss, sum(accs) / positions, step_s))


def save_checkpoint(output, run_id, step, epoch, positions):
    """`<output>/<run_id>-step<N>/` with a marker and a config; `<run_id>-latest` points at it."""
    path = os.path.join(output, "%s-step%d" % (run_id, step))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "STANDIN.txt"), "w") as fh:
        fh.write("stand-in checkpoint written by remote-ops' SpecForge training stand-in: no weights\n")
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({"standin": True, "architectures": ["LlamaForCausalLMEagle3"], "step": step, "epoch": epoch,
                   "num_positions": positions}, fh, indent=1)
    link = os.path.join(output, "%s-latest" % run_id)
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.basename(path), tmp)
    os.replace(tmp, link)


def epoch_summary(fh, epoch, epochs, positions):
    for i in range(positions):
        log(fh, "Train Epoch [%d/%d], position %d,  Acc: %.2f" % (epoch + 1, epochs, i, synthetic_acc(epoch, 1, i)))
    for i in range(positions):
        log(fh, "Train Epoch [%d/%d], position %d, pLoss: %.2f" % (epoch + 1, epochs, i, synthetic_ploss(epoch, 1, i)))


def train(args, fh):
    start = time.monotonic()
    step = 0
    for epoch in range(args.epochs):
        for n in range(1, args.steps + 1):
            if STOP["flag"]:
                return "stopped"
            time.sleep(args.step_s)
            step += 1
            log(fh, tqdm_line(epoch, n, args.steps, time.monotonic() - start, args.step_s, args.positions), end="\r")
        log(fh, "")
        epoch_summary(fh, epoch, args.epochs, args.positions)
        save_checkpoint(args.output, args.run_id, step, epoch, args.positions)
    return "finished"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="specforge-standin-train")
    ap.add_argument("--log", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--data", default=None, help="exported SpecForge data (only counted, never read)")
    ap.add_argument("--run-id", default="eagle3")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per epoch")
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--positions", type=int, default=7)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(flag=True))
    os.makedirs(args.output, exist_ok=True)
    files = sum(len([f for f in fs if f.endswith(".ckpt")]) for _, _, fs in os.walk(args.data)) if args.data else 0
    with open(args.log, "a") as fh:
        log(fh, BANNER)
        log(fh, "stand-in run %s: %d epochs x %d steps, %d exported feature files found in %s"
            % (args.run_id, args.epochs, args.steps, files, args.data))
        state = train(args, fh)
        log(fh, "")
        log(fh, "SPECFORGE STAND-IN %s" % state)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""SpecForge TRAINING STAND-IN: trains nothing, needs no GPU, no model, no torch.

This is NOT SpecForge.  It exists so `remote-ops train start|status|stop` and
`logs summary` can be exercised end to end in the sandbox and the tests.  It
writes, at a steady pace:

- the metrics lines SpecForge 0.2.0 prints (`specforge/training/assembly.py::_logger`,
  called by its `TrainerController` every `log_interval` optimizer steps, tracking
  `report_to: none`): `step N: {'acc_0': .., ..., 'ploss_0': .., ..., 'acc': .., 'loss': ..,
  'lr': .., 'perf/...': ..}`, the same Python dict repr, plus one key that says
  what it is, `'STAND-IN/synthetic': 1.0`; at each epoch's end the evaluator's line
  (`eval/avg_loss`, `eval/per_position_acc`, `eval/simulated_acc_len`, `eval/ploss_i`).
  Every value is SYNTHETIC (a fixed curve); the log's first lines say so;
- checkpoint folders named as SpecForge 0.2.0's CheckpointManager names them,
  `<output>/<run_id>-step<N>` (one per epoch), plus the `<run_id>-latest` link, each
  holding a `STANDIN.txt` and a `config.json` with `"standin": true` - no weights.

Stops cleanly on SIGTERM (logs `stopped`).  Standard library only.
"""

import argparse
import json
import math
import os
import signal
import sys
import time

BANNER = (
    "SPECFORGE STAND-IN (remote-ops): no model, no GPU, nothing is trained; every accuracy and loss below is synthetic"
)
LABEL = {"STAND-IN/synthetic": 1.0}
STOP = {"flag": False}


def synthetic_acc(progress, position):
    """A fixed learning curve over epochs done: position 0 rises towards ~0.74, later positions lower."""
    return round(0.74 * (0.88**position) * (1 - math.exp(-(progress + 0.3) / 1.5)), 4)


def synthetic_ploss(progress, position):
    return round(2.5 * (1.1**position) * math.exp(-progress / 3.0) + 0.4, 4)


def log(fh, text):
    fh.write(text + "\n")
    fh.flush()


def metrics_line(step, progress, positions, lr, step_s):
    """One `step N: {...}` line as SpecForge 0.2.0's console logger prints it (dict of floats)."""
    acc = [synthetic_acc(progress, i) for i in range(positions)]
    ploss = [synthetic_ploss(progress, i) for i in range(positions)]
    printable = dict(LABEL)
    printable.update(("acc_%d" % i, float(v)) for i, v in enumerate(acc))
    printable.update(("ploss_%d" % i, float(v)) for i, v in enumerate(ploss))
    printable["acc"] = round(sum(acc) / positions, 6)
    printable["loss"] = round(sum(0.8**i * v for i, v in enumerate(ploss)), 6)
    printable["lr"] = float(lr)
    printable["perf/optimizer_steps_per_hour"] = 3600.0 / step_s
    printable["perf/optimizer_step_time_s"] = float(step_s)
    return "step %d: %s" % (step, printable)


def eval_line(step, progress, positions):
    acc = [round(0.97 * synthetic_acc(progress, i), 4) for i in range(positions)]
    chain, tau = 1.0, 1.0
    for a in acc:
        chain *= a
        tau += chain
    printable = dict(LABEL)
    printable.update(
        {
            "eval/avg_loss": round(sum(synthetic_ploss(progress, i) for i in range(positions)), 4),
            "eval/avg_acc": acc[0],
            "eval/per_position_acc": acc,
            "eval/simulated_acc_len": round(tau, 4),
        }
    )
    printable.update(("eval/ploss_%d" % i, round(1.02 * synthetic_ploss(progress, i), 4)) for i in range(positions))
    return "step %d: %s" % (step, printable)


def save_checkpoint(output, run_id, step, epoch, positions):
    """`<output>/<run_id>-step<N>/` with a marker and a config; `<run_id>-latest` points at it."""
    path = os.path.join(output, "%s-step%d" % (run_id, step))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "STANDIN.txt"), "w") as fh:
        fh.write(
            "STAND-IN checkpoint written by remote-ops' SpecForge training stand-in: no weights, nothing was trained\n"
        )
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(
            {
                "standin": True,
                "STAND-IN": "remote-ops training stand-in: no weights",
                "architectures": ["LlamaForCausalLMEagle3"],
                "step": step,
                "epoch": epoch,
                "num_positions": positions,
            },
            fh,
            indent=1,
        )
    link = os.path.join(output, "%s-latest" % run_id)
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.basename(path), tmp)
    os.replace(tmp, link)


def train(args, fh):
    step = 0
    for epoch in range(args.epochs):
        for n in range(1, args.steps + 1):
            if STOP["flag"]:
                return "stopped"
            time.sleep(args.step_s)
            step += 1
            if step % args.log_interval == 0:
                progress = epoch + n / args.steps
                lr = args.lr * min(1.0, step / max(1, args.steps))
                log(fh, metrics_line(step, progress, args.positions, lr, args.step_s))
        log(fh, eval_line(step, epoch + 1, args.positions))
        save_checkpoint(args.output, args.run_id, step, epoch, args.positions)
    return "finished"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="specforge-standin-train")
    ap.add_argument("--log", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--data", default=None, help="exported SpecForge data (only counted, never read)")
    ap.add_argument("--run-id", default="eagle3")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per epoch")
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--log-interval", type=int, default=1, help="as SpecForge's training.log_interval")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--positions", type=int, default=7)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(flag=True))
    os.makedirs(args.output, exist_ok=True)
    files = sum(len([f for f in fs if f.endswith(".ckpt")]) for _, _, fs in os.walk(args.data)) if args.data else 0
    with open(args.log, "a") as fh:
        log(fh, BANNER)
        log(
            fh,
            "SPECFORGE STAND-IN run %s: %d epochs x %d steps, %d exported feature files found in %s "
            "(counted, not read)" % (args.run_id, args.epochs, args.steps, files, args.data),
        )
        state = train(args, fh)
        log(fh, "SPECFORGE STAND-IN %s" % state)
    print("SPECFORGE STAND-IN %s: nothing was trained" % state)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`harness demo`: the embedded default run, with faults injected on purpose.

A tiny Llama is pretrained from scratch on the corpus shipped with the
package. The demo-only ``demo_faults`` plugin makes one batch's loss
non-finite, corrupts another batch, kills the process (SIGKILL) midway and
finally blows up the learning rate; the demo resumes from the last
checkpoint after the kill and finishes. At the end it
prints the findings, where the run directory and the MLflow store are, and
the command that opens the MLflow UI. No network, no GPU, no download.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from harness.core.findings import read_run_findings
from harness.report.record import RunRecord
from harness.report.verdict import verdict_of

DEMO_STEPS = 60
DEMO_FAULTS = {
    "nan_step": 8, "inf_grad_step": 11, "nan_batch_step": 14, "advance_lr_on_skipped_step": 11, "masked_step": 17, "padding_collator_step": 20, "spike_step": 31, "crash_step": 38,
    "diverge_from_step": 46, "diverge_lr_scale": 300,
}
DESYNC_STEPS = 20
DESYNC_FAULTS = {"perturb_param_at_step": 7, "scale_grad_at_step": 15}


def demo_config(out: Path) -> dict:
    from harness.lib.tiny import CORPUS_PATH

    return {
        "stage": "pretrain",
        "output_dir": str(out),
        "seed": 0,
        "model": {"preset": "tiny-llama", "overrides": {"hidden_size": 64, "num_layers": 2, "num_heads": 4}},
        "tokenizer": {"vocab_size": 512},
        "data": {"sources": [{"path": str(CORPUS_PATH), "max_repeats": 1}], "seq_len": 128},
        "training": {
            "max_steps": DEMO_STEPS,
            "per_device_train_batch_size": 8,
            "learning_rate": 0.003,
            "warmup_steps": 3,
            "save_strategy": "steps",
            "save_steps": 10,
            "logging_steps": 1,
            "use_cpu": True,
            "disable_tqdm": True,
        },
        "harness": {
            "plugins": ["defaults", "harness.stages.demo.faults:DemoFaults"],
            "report_plots": True,  # the demo's reports always show the curves
            "demo_faults": DEMO_FAULTS,
            "spike_capture": {"divergence_patience": 8},
            "packing_check": {"every": 20},
            "contamination": {"eval_sets": [{"path": str(out / "demo_eval.jsonl"), "field": "question", "name": "demo_quiz"}], "max_reports": 5},
        },
    }


def _run(config: Path, resume: bool) -> int:
    command = [sys.executable, "-m", "harness.cli", "run", "pretrain", "--config", str(config)] + (["--resume"] if resume else [])
    return subprocess.run(command).returncode


def run_demo(out: str | Path = "runs/demo") -> int:
    out = Path(out).resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = out / "demo.yaml"
    config.write_text(yaml.safe_dump(demo_config(out), sort_keys=False), encoding="utf-8")
    _contaminated_eval_set(out / "demo_eval.jsonl")
    began = time.time()
    print(f"harness demo: pretraining a tiny Llama for {DEMO_STEPS} steps in {out}")
    f = DEMO_FAULTS
    print(f"  faults injected on purpose: non-finite loss at step {f['nan_step']} (once: a rerun of the step is clean), infinite gradients at step {f['inf_grad_step']} "
          f"(whose skipped update still moves the LR scheduler), "
          f"a NaN sample in the batch of step {f['nan_batch_step']} (a rerun reproduces it), all labels masked at step {f['masked_step']}, a padding collator's batch at step {f['padding_collator_step']}, "
          f"corrupted batch at step {f['spike_step']}, kill -9 at step {f['crash_step']}, learning rate blown up from step "
          f"{f['diverge_from_step']}, and an eval set that holds {CONTAMINATED_LINES} lines of the training corpus; then a resume "
          "done wrong, and two data-parallel processes that drift apart", flush=True)
    first = _run(config, resume=False)
    if first == 0:
        print("harness demo: the simulated crash did not happen; nothing to resume")
    else:
        print(f"\nharness demo: the training process died (exit {first}, the simulated kill -9); resuming from the last checkpoint", flush=True)
        second = _run(config, resume=True)
        if second != 0:
            print(f"harness demo: the resumed run failed with exit {second}")
            return second
    desync, process = _start_desync(out)  # runs while the resume done wrong does: the two are independent
    broken = _broken_resume(out)
    desync_code = process.wait()
    if desync_code != 0:
        print(f"harness demo: the two-process run failed with exit {desync_code}; see {desync / 'train.log'}")
    return _summary(out, time.time() - began, broken, desync) or desync_code


CONTAMINATED_LINES = 40  # corpus lines copied into the demo's eval set (the training data holds them)


def _contaminated_eval_set(path: Path) -> None:
    """An eval set of made-up questions plus lines of the training corpus: the leak the contamination plugin must see."""
    import json
    import random

    from harness.lib.tiny import corpus_lines

    rng = random.Random(0)
    made_up = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9))) for _ in range(20))
               for _ in range(10)]
    leaked = corpus_lines()[:CONTAMINATED_LINES]
    records = [{"id": f"made-up-{i}", "question": q} for i, q in enumerate(made_up)]
    records += [{"id": f"leaked-{i}", "question": q} for i, q in enumerate(leaked)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


BROKEN_RESUME_FROM = 30


def _broken_resume(out: Path) -> Path:
    """Resume checkpoint-30 again the wrong way: optimizer.pt lost and the data position ignored.

    What the harness should make of it: the optimizer and scheduler not
    restored, the first batch not the one the interrupted run trained next,
    data repeated; training stops before its first update.
    """
    import shutil

    broken = out / "broken-resume"
    checkpoint = broken / f"checkpoint-{BROKEN_RESUME_FROM}"
    shutil.copytree(out / checkpoint.name, checkpoint)
    shutil.copytree(out / "harness" / "ledger", broken / "harness" / "ledger")  # what the first run trained, step by step
    (checkpoint / "optimizer.pt").unlink()
    config = demo_config(broken)
    config["training"]["ignore_data_skip"] = True
    config["harness"] = {"plugins": ["defaults"], "report_plots": True}
    path = broken / "demo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    print(f"\nharness demo: resuming checkpoint-{BROKEN_RESUME_FROM} again, the wrong way (optimizer.pt deleted, "
          f"ignore_data_skip=True), in {broken}", flush=True)
    command = [sys.executable, "-m", "harness.cli", "run", "pretrain", "--config", str(path), "--resume", str(checkpoint)]
    subprocess.run(command)
    return broken


def _start_desync(out: Path) -> tuple[Path, subprocess.Popen[bytes]]:
    """Start two data-parallel processes (DDP over gloo): a weight drifts on rank 1, then rank 1's reduced gradient is wrong.

    ``grad_sync`` checks every 5 steps and rebroadcasts rank 0's weights after
    each detection, so each fault is reported once, at the first check after it.
    Its output goes to ``desync/train.log``.
    """
    import socket

    run = out / "desync"
    config = demo_config(run)
    config["training"].update({"max_steps": DESYNC_STEPS, "save_strategy": "no", "per_device_train_batch_size": 4})
    config["harness"] = {
        "plugins": ["defaults", "harness.testing:FaultInjector"],
        "report_plots": True,
        "grad_sync": {"every": 5, "on_desync": "rebroadcast"},
        "fault_injector": DESYNC_FAULTS,
    }
    run.mkdir(parents=True, exist_ok=True)
    path = run / "demo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print(f"\nharness demo: two data-parallel processes (DDP, gloo) for {DESYNC_STEPS} steps in {run}: one weight of rank 1 "
          f"moved by one ulp after step {DESYNC_FAULTS['perturb_param_at_step']}, rank 1's reduced gradient 1.5x too large at "
          f"step {DESYNC_FAULTS['scale_grad_at_step']} (its output: {run / 'train.log'})", flush=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    with open(run / "train.log", "wb") as log:
        process = subprocess.Popen([*launcher, "-m", "harness.cli", "run", "pretrain", "--config", str(path)], stdout=log, stderr=subprocess.STDOUT)
    return run, process


def _print_findings(title: str, run: Path) -> None:
    findings = read_run_findings(run / "harness")
    print(f"\n{title} ({run}), findings ({len(findings)}):")
    for finding in findings:
        print(f"  [{finding.severity.value:<8}] step {finding.step!s:>3}  {finding.code:<30} -> {finding.action or 'continue':<10} {finding.message}")


def _summary(out: Path, seconds: float, broken: Path, desync: Path) -> int:
    run_dir = out / "harness"
    findings = read_run_findings(run_dir)
    print(f"\nharness demo: finished in {seconds:.0f} s. Findings ({len(findings)}):")
    for finding in findings:
        print(f"  [{finding.severity.value:<8}] step {finding.step!s:>3}  {finding.code:<22} -> {finding.action or 'continue':<10} {finding.message}")
    counts = Counter(f.code for f in findings)
    print("  by code: " + ", ".join(f"{code} x{n}" for code, n in sorted(counts.items())))
    _print_findings("the resume done wrong", broken)
    _print_findings("the data-parallel replicas that drift apart", desync)
    # the first spike whose replay checkpoint (the step before it) exists: a spike between saves has none
    spikes = [f for f in findings if f.code == "LOSS_SPIKE" and f.evidence.get("capture") and (out / f"checkpoint-{f.step - 1}").is_dir()]
    if spikes:
        capture = Path(spikes[0].evidence["capture"]).parent
        print(f"\nthe batch behind the first loss spike, most suspect sample first: {capture / 'summary.rank-0.md'}")
        print(f"recompute its per-sample losses on checkpoint-{spikes[0].step - 1}: harness replay {capture}")
    print("\nreports (verdict first, each finding linked to its playbook section):")
    for run in (out, broken, desync):
        verdict = verdict_of(RunRecord.load(run / "harness"))
        print(f"  {run / 'harness' / 'report.html'}\n    {verdict.line()}")
    print(f"the next step for every finding: harness explain {out}")
    store = run_dir / "mlflow" / "mlflow.db"
    print(f"\nrun directory: {run_dir}  (findings.jsonl, steps.jsonl, run.json, report.md, config.yaml, mlflow/)")
    print(f"MLflow store:  sqlite:///{store}")
    print(f"open the MLflow UI: mlflow ui --backend-store-uri sqlite:///{store} --port 5000")
    return 0

"""Start-up and wrap-up cost: a 30-step ``examples/run_clm.py`` job, plain vs under ``harness wrap`` (whole commands).

What a user waits for is the whole job: the launcher validating the config,
the child attaching the harness, training, the report at the end. Rounds
alternate plain, wrapped, plain, wrapped ... on the same data (written once by
``examples/clm_data.py``) so that machine drift hits both alike; the result is
the median of each side with its interquartile range, the median of the
per-round differences, and the launcher alone (``harness wrap -- true``).

    python benchmarks/startup.py [--rounds 5] [--steps 30]

The last printed line is always ``wrapped - plain (median of rounds): X.XX s``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(sys.executable).with_name("harness")


def timed(command: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... exited {result.returncode}:\n{result.stderr[-3000:]}")
    return seconds


def quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f} s"
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:.2f} s (IQR {q1:.2f}-{q3:.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("HARNESS_CONFIG", "HARNESS_PLUGINS"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="harness-startup-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, str(REPO / "examples" / "clm_data.py"), "--out", str(work / "data")], check=True, stdout=subprocess.DEVNULL)
        script = [sys.executable, str(REPO / "examples" / "run_clm.py"), "--train_file", str(work / "data" / "train.txt"),
                  "--validation_file", str(work / "data" / "validation.txt"), "--do_train", "--do_eval", "--max_steps", str(args.steps),
                  "--per_device_train_batch_size", "4", "--logging_steps", "1", "--use_cpu", "--report_to", "none",
                  "--save_strategy", "no", "--disable_tqdm", "true"]
        plain, wrapped, launcher = [], [], []
        for r in range(args.rounds):
            plain.append(timed([*script, "--output_dir", str(work / f"plain-{r}")], env, work))
            wrapped.append(timed([str(HARNESS), "wrap", "--", *script, "--output_dir", str(work / f"wrapped-{r}")], env, work))
            launcher.append(timed([str(HARNESS), "wrap", "--", "true"], env, work))
            print(f"round {r + 1}: plain {plain[-1]:.2f} s, wrapped {wrapped[-1]:.2f} s, launcher alone {launcher[-1]:.2f} s", flush=True)
    print(f"plain job:     {quartiles(plain)}")
    print(f"wrapped job:   {quartiles(wrapped)}")
    print(f"launcher only (`harness wrap -- true`): {quartiles(launcher)}")
    print(f"wrapped / plain (median): {statistics.median(wrapped) / statistics.median(plain):.3f}x")
    print(f"wrapped - plain (median of rounds): {statistics.median(w - p for w, p in zip(wrapped, plain)):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

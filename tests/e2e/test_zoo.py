"""Issue 43 item 8: the model-zoo matrix, each family and task through ``harness wrap`` of an unmodified script.

Every cell is one job of the project's own user-style scripts
(``examples/train_zoo.py``: GPT-2, Qwen3, a Qwen3-MoE and Gemma3 text as causal
LMs, Llama and BERT classification heads, a BERT masked LM, T5 through
``Seq2SeqTrainer`` with generate-based evaluation; ``examples/train_embeddings.py``:
a SentenceTransformer with ``MultipleNegativesRankingLoss``), run the way a
scheduler runs a job with a time budget: the first job trains 6 of 12 steps,
evaluates, saves ``checkpoint-6`` and ends; ``harness resume-point`` must name
that checkpoint (proven, exit 0); the requeued job resumes from the path it
printed, with the same arguments, and trains steps 7-12. Each job must exit 0
and the run must stay silent: no finding at warning or above, and no
``RESUME_*`` finding of any severity. The default plugins run, and
``layer_stats``, which walks every family's blocks: it must measure their
attention logits or say why not (never a silent null). One test per cell, so a failure names
the family and the task.

A Qwen3-MoE is the exception the world makes: transformers' Trainer resumes
its weights by their saved names, and the experts are saved converted (one
tensor per expert), so the Trainer's resume leaves them as the requeued script
built them. Its requeued job loads the model from the checkpoint first (a
clean resume, silent like the others); the same job without that is stopped
by ``RESUME_MODEL_MISMATCH`` before it trains a step.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import EXAMPLES, findings_of, harness_cli, read_jsonl, write_yaml

MAX_STEPS, STOP_AT = 12, 6
LOUD = ("warning", "error", "critical")

# cell id -> the script and its model/task arguments
CELLS: dict[str, list[str]] = {
    "gpt2-causal_lm": ["train_zoo.py", "--family", "gpt2", "--task", "causal_lm"],
    "qwen3-causal_lm": ["train_zoo.py", "--family", "qwen3", "--task", "causal_lm"],
    "qwen3_moe-causal_lm": ["train_zoo.py", "--family", "qwen3_moe", "--task", "causal_lm"],
    "gemma3-causal_lm": ["train_zoo.py", "--family", "gemma3", "--task", "causal_lm"],
    "llama-classification_2_labels": ["train_zoo.py", "--family", "llama", "--task", "sequence_classification", "--num_labels", "2"],
    "bert-classification_3_labels": ["train_zoo.py", "--family", "bert", "--task", "sequence_classification", "--num_labels", "3"],
    "bert-masked_lm": ["train_zoo.py", "--family", "bert", "--task", "masked_lm"],
    "t5-seq2seq": ["train_zoo.py", "--family", "t5", "--task", "seq2seq"],
    "sentence_transformer-embeddings": ["train_embeddings.py"],
}
# transformers saves a Qwen3-MoE's fused experts per expert, and the Trainer's resume loads the saved names as they are
# (load_state_dict, strict=False): the experts would stay as the requeued script built them. The requeued job of such a
# cell builds its model from the checkpoint with from_pretrained, which converts them back (what resume-point advises).
LOAD_MODEL_FROM_CHECKPOINT = {"qwen3_moe-causal_lm"}


def wrapped_job(cell: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """One job of the cell's script under ``harness wrap`` (12 steps, a save and an evaluation every 6).

    The default plugins and ``layer_stats`` (every 3 steps), which walks each family's modules and attention.
    """
    script, *model = CELLS[cell]
    config = write_yaml(out.parent / "harness.yaml", {"plugins": ["defaults", "layer_stats"], "layer_stats": {"interval": 3}})
    return harness_cli(
        "wrap", "--config", str(config), "--", sys.executable, str(EXAMPLES / script), *model, "--output_dir", str(out), "--max_steps", str(MAX_STEPS),
        "--save_steps", str(STOP_AT), "--eval_steps", str(STOP_AT), "--learning_rate", "1e-3", *extra,
    )


def shown(findings: list[dict[str, Any]]) -> str:
    """The findings one per line: severity, code, step, plugin and the message's first line."""
    lines = [f"{f['severity']} {f['code']} step {f['step']} ({f['plugin']}): {str(f['message']).splitlines()[0][:300]}" for f in findings]
    return "\n".join(lines) or "(none)"


def assert_job_ran(result: subprocess.CompletedProcess[str], out: Path, what: str) -> None:
    findings = findings_of(out) if (out / "harness" / "findings.jsonl").is_file() else []
    assert result.returncode == 0, f"{what} exited {result.returncode}\nfindings:\n{shown(findings)}\nstderr:\n{result.stderr[-3000:]}"


def assert_silent(out: Path, what: str) -> None:
    findings = findings_of(out)
    loud = [f for f in findings if f["severity"] in LOUD or f["code"].startswith("RESUME_")]
    assert loud == [], f"{what}: findings at warning or above (or RESUME_*):\n{shown(loud)}\nall findings:\n{shown(findings)}"


def first_job(cell: str, out: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """The job that trains 6 of 12 steps and ends; the checkpoint resume-point names (checked) and resume-point's answer."""
    first = wrapped_job(cell, out, "--stop_after_step", str(STOP_AT))
    assert_job_ran(first, out, "the first job")
    assert_silent(out, "the first job")
    point = harness_cli("resume-point", str(out))
    assert point.returncode == 0, f"harness resume-point exited {point.returncode}: {point.stderr.strip()[-2000:]}\n{shown(findings_of(out))}"
    checkpoint = point.stdout.strip()
    assert Path(checkpoint) == out / f"checkpoint-{STOP_AT}", point.stdout
    return checkpoint, point


def assert_attention_measured(out: Path) -> None:
    """layer_stats measured the attention logits of the family's blocks, or said why it could not (never a silent null)."""
    rows = read_jsonl(out / "harness" / "layer_stats.jsonl")
    measured = sorted({r["block"] for r in rows if r.get("attn_logit_max") is not None})
    said = [f for f in findings_of(out) if f["plugin"] == "layer_stats"]
    assert rows and (measured or said), f"layer_stats: no block's attn_logit_max measured ({len(rows)} rows) and no finding says why"


def attempts_of(out: Path) -> list[tuple[Any, ...]]:
    attempts = json.loads((out / "harness" / "run.json").read_text(encoding="utf-8"))["attempts"]
    return [(a["resumed_from"], a["start_step"], a.get("end_step"), a["status"]) for a in attempts]


@pytest.mark.slow  # two wrapped jobs of a client script per cell
@pytest.mark.parametrize("cell", list(CELLS))
def test_a_clean_job_is_silent_and_its_requeued_job_resumes_from_the_checkpoint_resume_point_names(cell: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    checkpoint, _ = first_job(cell, out)

    model = ["--model_name_or_path", checkpoint] if cell in LOAD_MODEL_FROM_CHECKPOINT else []
    second = wrapped_job(cell, out, *model, "--resume_from_checkpoint", checkpoint)
    assert_job_ran(second, out, "the resumed job")
    assert_silent(out, "the resumed job")
    assert attempts_of(out) == [(None, 0, STOP_AT, "completed"), (checkpoint, STOP_AT, MAX_STEPS, "completed")]
    assert_attention_measured(out)


@pytest.mark.slow  # two wrapped jobs of a client script
def test_a_moe_job_requeued_the_way_the_trainer_resumes_it_is_stopped_because_its_experts_were_not_restored(tmp_path: Path) -> None:
    """The Trainer's own resume leaves a Qwen3-MoE's experts as built: resume-point warns, and resume_check stops before step 7."""
    out = tmp_path / "run"
    checkpoint, point = first_job("qwen3_moe-causal_lm", out)
    assert "experts" in point.stderr, point.stderr

    second = wrapped_job("qwen3_moe-causal_lm", out, "--resume_from_checkpoint", checkpoint)
    findings = findings_of(out)
    assert second.returncode == 75, f"the resumed job exited {second.returncode}\n{shown(findings)}\n{second.stderr[-3000:]}"
    mismatch = [f for f in findings if f["code"] == "RESUME_MODEL_MISMATCH"]
    assert mismatch and mismatch[0]["severity"] in ("error", "critical") and "experts" in mismatch[0]["message"], shown(findings)
    assert not (out / f"checkpoint-{MAX_STEPS}").exists()  # it trained no step on the unrestored experts

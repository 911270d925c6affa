"""The contamination plugin's finding codes and options (shared by its modules, importable without torch)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity

CONTAMINATION = FindingCode(
    "CONTAMINATION",
    Severity.WARNING,
    "A training batch contains text of an eval example: scores on that example measure memory, not skill.",
    "contamination#contamination",
)
EVAL_SPLIT_OVERLAP = FindingCode(
    "EVAL_SPLIT_OVERLAP",
    Severity.WARNING,
    "The Trainer's eval dataset shares samples with its train dataset: eval loss and metrics look better than they are.",
    "contamination#eval_split_overlap",
)
CONTAMINATION_SUMMARY = FindingCode(
    "CONTAMINATION_SUMMARY",
    Severity.WARNING,
    "Eval examples hold training text: how many of each eval set, judged by the spans of training text they hold.",
    "contamination#contamination_summary",
)
CONTAMINATION_UNCHECKED = FindingCode(
    "CONTAMINATION_UNCHECKED",
    Severity.WARNING,
    "An eval set named in config could not be indexed, so training is not checked against it.",
    "contamination#contamination_unchecked",
)


class EvalSet(BaseModel):
    """One eval set to watch for."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="A .txt (one example per line), .jsonl, .parquet file or `datasets` folder.")
    field: str = Field("text", description="The field holding the example's text.")
    name: str | None = Field(None, description="Name in findings and summaries (default: the file name).")
    id_field: str = Field("id", description="The field holding the example's id (default: file:line).")


class ContaminationOptions(BaseModel):
    """Options of the ``contamination`` plugin."""

    model_config = ConfigDict(extra="forbid")

    eval_sets: list[EvalSet] = Field(default_factory=list, description="Eval sets whose examples must not appear in training batches.")
    trainer_eval: bool = Field(True, description="Also watch for the rows of the Trainer's eval_dataset (token ids as they are).")
    n: int = Field(13, ge=2, description="n-gram length in tokens.")
    min_length: int = Field(8, ge=1, description="Eval examples shorter than this many tokens are not indexed (too short to tell).")
    template_min_examples: int = Field(10, ge=0, description="n-grams shared by this many eval examples are templates and left out (0 keeps all).")
    sample_every: int = Field(1, ge=1, description="Check one micro-batch in this many.")
    dirty_fraction: float = Field(0.5, ge=0, le=1, description="An example is dirty (a CONTAMINATION finding) from this fraction of its n-grams "
                                                                "seen in training, over all micro-batches, steps and ranks of the run "
                                                                "(n-grams across a line or document boundary of a joined row not counted).")
    dirty_span: int = Field(32, ge=0, description="An example is dirty whatever its fraction when it holds a training span this many "
                                                  "tokens long (consecutive matched n-grams within a line or document; 0: off).")
    scale_to_text: bool = Field(True, description="`n` and `dirty_span` count tokens of a usual tokenizer (about 4 characters of "
                                                  "English per token: GPT-2's, Llama's). When the run's tokenizer holds fewer "
                                                  "characters of the eval text per token (a small vocabulary, bytes, characters), "
                                                  "both are scaled up to hold about as much text, said once on the console "
                                                  "(a 13-gram of a 512-token vocabulary is three words, which templates share). "
                                                  "false: count tokens as given.")
    partial_fraction: float = Field(0.0, ge=0, le=1, description="Run-end status partial above this fraction (below dirty_fraction: "
                                                                  "summary and report only, no finding).")
    check_split_overlap: bool = Field(True, description="EVAL_SPLIT_OVERLAP: compare the Trainer's train and eval rows before training.")
    max_reports: int = Field(20, ge=1, description="CONTAMINATION findings per run at most (each eval example once; the summary counts all).")

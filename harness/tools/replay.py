"""``harness replay``: recompute a capture's per-sample losses and gradient norms on a checkpoint, to confirm what a capture blames.

The capture holds the micro-batch tensors and the RNG state of the forward
pass that produced its per-sample losses. Loading the checkpoint the capture
was taken on (the one saved at the step before the spike) and running the
same forward pass must give the same numbers; a different checkpoint shows
how the blamed samples fare on other weights (e.g. before the data changed).
The per-sample gradient norms (:mod:`harness.lib.sample_grads`: one backward
per row) are recomputed alike and printed beside the losses; the verdict
compares the losses.
"""
from __future__ import annotations

import math
import re
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.lib.capture import lm_inputs, per_sample_loss, set_rng_state
from harness.lib.sample_grads import Blame, blame_rows
from harness.core.errors import HarnessError
from harness.core.received import read_received_json
from harness.core.terminal_text import terminal_text


@dataclass
class ReplayRow:
    micro_batch: int
    row: int
    sample_id: Any
    captured: float | None
    replayed: float
    text: str
    grad_norm: float | None = None  # recomputed on the checkpoint, like ``replayed``
    captured_grad_norm: float | None = None

    @property
    def diff(self) -> float | None:
        if self.captured is None:
            return None
        if math.isnan(self.captured) or math.isnan(self.replayed):
            return 0.0 if math.isnan(self.captured) and math.isnan(self.replayed) else math.inf
        if math.isinf(self.captured) or math.isinf(self.replayed):
            return 0.0 if self.captured == self.replayed else math.inf
        return abs(self.replayed - self.captured)


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)  # "nan" / "inf" strings parse too


def find_capture_file(capture_dir: Path, rank: int | None) -> Path:
    if capture_dir.is_file():
        raise HarnessError(f"{capture_dir} is a file; replay takes the capture's folder. Fix: harness replay {capture_dir.parent}")
    if not capture_dir.is_dir():
        raise HarnessError(f"capture directory {capture_dir} does not exist; captures are under <output_dir>/harness/captures/step-<N>/.")
    files = sorted(capture_dir.glob("capture.rank-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if rank is not None:
        files = [f for f in files if f.stem == f"capture.rank-{rank}"]
    if not files:
        which = f" for rank {rank}" if rank is not None else ""
        raise HarnessError(f"no capture.rank-*.json{which} in {capture_dir}; pass the step-<N> directory of a capture (or another --rank).")
    return files[0]


TABLE_WIDTH = 160  # the replay table's columns with their numbers whole and 40 characters of text

CAPTURE_KEYS = {"code": str, "step": int, "rank": int, "weights_from_step": int, "samples": list}
BATCH_KEYS = ("micro_batches", "micro_batch_index", "rng")


def read_capture(capture_file: Path) -> dict[str, Any]:
    """``capture.rank-<r>.json`` as data, checked: a damaged or hand-edited file is a HarnessError naming the key."""
    fix = "Fix: use the capture folder as the run wrote it (copy it again from the run directory)."
    try:
        meta = read_received_json(capture_file)  # never a link, a FIFO or a device; capped
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{capture_file} cannot be read as JSON ({exc}). {fix}") from None
    if not isinstance(meta, dict):
        raise HarnessError(f"{capture_file} holds a JSON {type(meta).__name__}, not the capture's object. {fix}")
    for key, kind in CAPTURE_KEYS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = "missing" if key not in meta else f"a {type(value).__name__} ({str(value)[:40]!r})"
            raise HarnessError(f"{capture_file}: key '{key}' is {got}, not {'a whole number' if kind is int else 'a ' + kind.__name__}. {fix}")
    if not all(isinstance(s, dict) for s in meta["samples"]):
        raise HarnessError(f"{capture_file}: key 'samples' holds entries that are not objects. {fix}")
    return meta


def read_batches(batch_file: Path) -> dict[str, Any]:
    """``batch.rank-<r>.pt`` (tensors only: ``weights_only``), checked for what replay needs."""
    fix = "Fix: use the capture folder as the run wrote it (copy it again from the run directory)."
    try:
        saved = torch.load(batch_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's unpickler raises many kinds for a damaged file
        raise HarnessError(f"{batch_file} cannot be read as the capture's tensors ({type(exc).__name__}: {exc}). {fix}") from None
    missing = [key for key in BATCH_KEYS if not isinstance(saved, dict) or key not in saved]
    if missing:
        raise HarnessError(f"{batch_file} lacks {', '.join(missing)}. {fix}")
    return saved


def find_checkpoint(meta: dict[str, Any], capture_file: Path) -> tuple[Path, bool]:
    """The checkpoint saved at the step before the capture, else the latest before it; (path, exact).

    Only a checkpoint complete for the Trainer counts (``trainer_state.json``
    and the weights, :func:`harness.lib.checkpoints.trainer_missing`): a save
    killed half-way leaves a ``checkpoint-<N>`` whose weights may be partial.
    The run directory the capture lies in comes first: the ``output_dir``
    stored in ``capture.json`` is absolute, so for a run directory copied or
    moved elsewhere it names the old place (or another run now living
    there). It is looked at only when no checkpoint lies beside the capture.
    """
    checkpoint, exact, _ = _find_checkpoint(meta, capture_file)
    return checkpoint, exact


def _find_checkpoint(meta: dict[str, Any], capture_file: Path) -> tuple[Path, bool, list[tuple[Path, list[str]]]]:
    """:func:`find_checkpoint`, and the newer checkpoints it passed over as incomplete (folder, what it lacks)."""
    from harness.lib.checkpoints import checkpoint_step, list_checkpoints, trainer_missing

    wanted = int(meta["weights_from_step"])
    candidates = []
    located = capture_file.absolute()  # `harness replay step-4` from inside captures/ is in its run too (links kept)
    in_run = located.parent.parent.name == "captures" and located.parents[2].name == "harness"
    if in_run:  # <output_dir>/harness/captures/step-<N>/: the run's own checkpoints lie in <output_dir>
        candidates.append(located.parents[3])
    stored = meta.get("output_dir")
    # the place the run trained in, only when absolute: an older capture stored the path as the script was given it
    # (``runs/x``), and read from another directory that names another run's checkpoints
    if isinstance(stored, str) and stored and Path(stored).is_absolute() and Path(stored).resolve() not in {c.resolve() for c in candidates}:
        candidates.append(Path(stored))
    if not candidates:
        raise HarnessError(
            f"the capture {capture_file.parent} lies outside its run directory and names no absolute output_dir, so its "
            "checkpoints cannot be found. Fix: pass --checkpoint DIR (the checkpoint of the step before the capture)."
        )
    for base in candidates:
        found = [c for c in list_checkpoints(base) if checkpoint_step(c) <= wanted]  # type: ignore[operator]  # newest first
        if not found:
            continue
        # the first place with a checkpoint wins: never mix the copy's checkpoints with the original's
        skipped: list[tuple[Path, list[str]]] = []
        for checkpoint in found:
            missing = trainer_missing(checkpoint)
            if not missing:
                return checkpoint, checkpoint_step(checkpoint) == wanted, skipped
            skipped.append((checkpoint, missing))
        lacks = "; ".join(f"{c} lacks {', '.join(m)}" for c, m in skipped)
        raise HarnessError(
            f"no complete checkpoint at or before step {wanted} in {base}: {lacks} (a save that did not finish; "
            "the weights in it may be partial). Fix: pass --checkpoint DIR (a complete Trainer checkpoint or a saved "
            "model directory)."
        )
    raise HarnessError(
        f"no checkpoint at or before step {wanted} next to the capture (looked in {', '.join(str(c) for c in candidates)}); "
        "pass --checkpoint DIR (a Trainer checkpoint or a saved model directory)."
    )


def load_model(checkpoint: Path, meta: dict[str, Any], device: str) -> Any:
    if not Path(checkpoint).is_dir():
        # never a hub id: from_pretrained would take a mistyped local path for a model name and look it up online
        what = "does not exist" if not Path(checkpoint).exists() else "is not a directory"
        raise HarnessError(
            f"checkpoint {checkpoint} {what} (resolved: {Path(checkpoint).resolve()}). "
            "Pass --checkpoint with a local Trainer checkpoint or saved model directory (config.json and weights)."
        )
    from transformers import AutoModelForCausalLM

    model_info = meta.get("model", {})
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}  # a checkpoint's auto_map code never runs
    dtype = getattr(torch, model_info["dtype"], None) if isinstance(model_info.get("dtype"), str) else None
    if isinstance(dtype, torch.dtype):  # a name from the capture file: a torch dtype, never any other attribute of torch
        kwargs["dtype"] = dtype
    if model_info.get("attn_implementation"):
        kwargs["attn_implementation"] = model_info["attn_implementation"]
    try:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), **kwargs)
    except (OSError, ValueError) as exc:
        detail = " ".join(str(exc).split()).rstrip(".")
        raise HarnessError(f"could not load a model from {checkpoint}: {detail}. Fix: pass --checkpoint with a directory that has "
                           "config.json and weights.") from None
    model.to(device)
    model.train(bool(model_info.get("training_mode", True)))
    return model


def _autocast(device: str, precision: str | None) -> AbstractContextManager[Any]:
    """The autocast the Trainer's forward ran under (accelerate's bf16/fp16), so that replay computes alike."""
    if precision not in ("bf16", "fp16"):
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def default_tolerance(meta: dict[str, Any]) -> float:
    """fp32 forward passes agree to ~1e-6; under bf16/fp16 autocast or in half precision only to ~1e-2."""
    model = meta.get("model", {})
    half = model.get("autocast") or model.get("dtype") in ("bfloat16", "float16")
    return 2e-2 if half else 1e-4


def replay(capture_dir: Path, checkpoint: Path | None = None, rank: int | None = None, device: str = "cpu") -> tuple[dict[str, Any], Path, bool, list[ReplayRow]]:
    """Recompute the per-sample losses and gradient norms of a capture; returns (meta, checkpoint used, exact checkpoint, rows)."""
    meta, used, exact, rows, _ = replay_with_blame(capture_dir, checkpoint, rank, device)
    return meta, used, exact, rows


def replay_with_blame(
    capture_dir: Path, checkpoint: Path | None = None, rank: int | None = None, device: str = "cpu"
) -> tuple[dict[str, Any], Path, bool, list[ReplayRow], Blame]:
    """:func:`replay`, and how the per-sample gradient norms were recomputed (method, seconds)."""
    capture_file = find_capture_file(Path(capture_dir), rank)
    meta = read_capture(capture_file)
    batch_file = capture_file.with_name(capture_file.name.replace("capture.", "batch.").replace(".json", ".pt"))
    if not batch_file.exists():
        raise HarnessError(f"{batch_file} is missing: the capture's tensors are needed to replay it.")
    saved = read_batches(batch_file)
    if checkpoint is None:
        checkpoint, exact = find_checkpoint(meta, capture_file)
    else:
        named = re.fullmatch(r"checkpoint-(\d+)", Path(checkpoint).name)
        exact = named is not None and int(named.group(1)) == int(meta["weights_from_step"])
    model = load_model(Path(checkpoint), meta, device)
    set_rng_state(saved["rng"])
    recorded = {(s["micro_batch"], s["row"]): s for s in meta["samples"]}
    rows: list[ReplayRow] = []
    autocast = meta.get("model", {}).get("autocast")
    batches = [{k: v.to(device) for k, v in tensors.items()} for tensors in saved["micro_batches"]]
    for micro, batch in zip(saved["micro_batch_index"], batches):
        with _autocast(device, autocast):
            losses = per_sample_loss(model, batch)
        if losses is None:
            raise HarnessError(f"micro-batch {micro} of {capture_file} is not a causal-LM batch (no input_ids and labels); it cannot be replayed.")
        for r, value in enumerate(losses.tolist()):
            s = recorded.get((micro, r), {})
            rows.append(ReplayRow(micro, r, s.get("sample_id"), _as_float(s.get("loss")), value, (s.get("text") or "")[:50],
                                  captured_grad_norm=_as_float(s.get("grad_norm"))))
    with _autocast(device, autocast):  # from the capture's RNG, as the capture computed them
        blame = blame_rows(model, [lm_inputs(b) for b in batches], saved["rng"])
    norms = {(micro, r): value for micro, n in zip(saved["micro_batch_index"], blame.norms) if n is not None for r, value in enumerate(n.tolist())}
    for row in rows:
        row.grad_norm = norms.get((row.micro_batch, row.row))
    order = {(s["micro_batch"], s["row"]): i for i, s in enumerate(meta["samples"])}
    rows.sort(key=lambda x: order.get((x.micro_batch, x.row), len(order)))
    return meta, Path(checkpoint), exact, rows, blame


def print_replay(capture_dir: Path, checkpoint: Path | None, rank: int | None, device: str | None, tolerance: float | None) -> int:
    """The CLI: print the table; exit 0 when the captured numbers are reproduced, 1 when they are not."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise HarnessError(f"--tolerance {tolerance:g} is not a tolerance. Fix: pass a number of 0 or more, e.g. 1e-4.")

    capture_file = find_capture_file(Path(capture_dir), rank)
    meta = read_capture(capture_file)
    captured_on = meta.get("model", {}).get("device_type") or "cpu"
    device = device or (captured_on if captured_on == "cpu" or torch.cuda.is_available() else "cpu")
    tolerance = default_tolerance(meta) if tolerance is None else tolerance
    # a pipe, a CI log or an 80-column terminal: rich would cut the numbers to "6.588…"; the table needs about 150
    # columns, and a line the terminal wraps keeps its numbers whole
    console = Console(width=max(Console().width, TABLE_WIDTH))
    if checkpoint is None:
        checkpoint, _, skipped = _find_checkpoint(meta, capture_file)
        for folder, missing in skipped:
            console.print(f"skipped {folder}: it lacks {', '.join(missing)} (a save that did not finish).",
                          style="yellow", markup=False, highlight=False)  # a path is no markup
    meta, used, exact, rows, blame = replay_with_blame(capture_dir, checkpoint, rank, device)
    if device != captured_on:
        console.print(f"[yellow]the capture ran on {captured_on}, this replay on {device}: kernels differ, expect small differences.[/yellow]")
    # the capture's fields and the sample text are data: plain Text (no rich markup, no OSC 8 link), controls shown inert
    table = Table(title=Text(terminal_text(f"{meta['code']} at step {meta['step']}, rank {meta['rank']}: per-sample loss and "
                                           f"grad norm on {used}")))
    for column in ("suspect", "micro-batch", "row", "sample id", "captured", "replayed", "|diff|", "captured grad norm",
                   "replayed grad norm", "text"):
        if column == "text":
            table.add_column(column, justify="left", overflow="ellipsis", no_wrap=True, max_width=40)
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for i, row in enumerate(rows, 1):
        diff = row.diff
        table.add_row(
            str(i), str(row.micro_batch), str(row.row), Text(terminal_text(str(row.sample_id))),
            "-" if row.captured is None else f"{row.captured:.5f}",
            f"{row.replayed:.5f}", "-" if diff is None else f"{diff:.2e}",
            "-" if row.captured_grad_norm is None else f"{row.captured_grad_norm:.4g}",
            "-" if row.grad_norm is None else f"{row.grad_norm:.4g}", Text(terminal_text(row.text.replace("\n", " "))),
        )
    console.print(table)
    console.print(f"per-sample gradient norms: {blame.method} ({blame.seconds:.3g} s" + (f"; {blame.why}" if blame.why else "") + ")",
                  markup=False, highlight=False)
    comparable = [r.diff for r in rows if r.diff is not None]
    if not exact:
        console.print(
            f"[yellow]{used} is not the checkpoint of step {meta['weights_from_step']} the capture was taken on: "
            "the numbers show these samples on other weights and are not expected to match.[/yellow]"
        )
        return 0
    if not comparable:
        console.print("The capture has no per-sample losses to compare with (they were not recomputed at capture time).")
        return 0
    worst = max(comparable)
    if worst <= tolerance:
        console.print(f"[green]reproduced: every per-sample loss within {tolerance:g} of the capture (max |diff| {worst:.2e}).[/green]")
        return 0
    console.print(
        f"[red]not reproduced: max |diff| {worst:.2e} > {tolerance:g}. Check that {used} holds the weights of step "
        f"{meta['weights_from_step']} and that the model code and dtype are unchanged.[/red]"
    )
    return 1

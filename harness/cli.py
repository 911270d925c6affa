"""The ``harness`` command line."""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Sequence

from harness.core.errors import HarnessError, HarnessStopped
from harness.lib.stops import EXIT_STOPPED

if TYPE_CHECKING:
    from harness.core.catalog import Catalog

QUIET_HELP = "no live console line per finding on stderr (as HARNESS_QUIET=1 or the config's console.level: off)"


def _cmd_wrap(args: argparse.Namespace) -> int:
    from harness.launch.wrap import run_wrapped

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    plugins = _names(args.plugins)
    only = _names(args.only) if args.only is not None else None
    return run_wrapped(command, config=args.config, plugins=plugins, quiet=args.quiet, only=only)


def _names(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _cmd_plugins(args: argparse.Namespace) -> int:
    from harness.core.catalog import Catalog
    from harness.core.config import config_reference

    catalog = Catalog.build()
    if args.config_reference:
        sys.stdout.write(config_reference(catalog))
        return 0
    if args.codes:
        for code in sorted(catalog.codes.values(), key=lambda c: c.code):
            owner = catalog.code_owner[code.code]
            print(f"{code.code:<32} {code.severity.value:<8} {owner:<16} {code.summary}")
        return 0
    from harness.core.config import CONFIG_ENV, ONLY_ENV, PLUGINS_ENV

    inherited = any(os.environ.get(name) is not None for name in (CONFIG_ENV, PLUGINS_ENV, ONLY_ENV))
    if args.config is not None or args.only is not None or args.plugins or inherited:
        return _print_selection(args, catalog)
    width = max((len(n) for n in catalog.entries), default=8)
    for name, entry in catalog.entries.items():
        flag = "on " if entry.default_enabled else "off"
        print(f"{name:<{width}}  {flag}  {entry.source:<10}  {entry.description}")
    return 0


def _print_selection(args: argparse.Namespace, catalog: Catalog) -> int:
    """Which plugins a run with this config (and ``--plugins``/``--only``) would enable: 'on' or 'off' for each."""
    from harness.core.config import effective_selection, load_config

    # as `harness wrap` would run it: the flags, else what the environment sets (HARNESS_CONFIG/PLUGINS/ONLY)
    selection = effective_selection(args.config, _names(args.plugins), _names(args.only) if args.only is not None else None)
    for note in selection.notes:
        sys.stderr.write(f"harness plugins: note: {note}.\n")
    resolved = load_config(selection.config if selection.config else {}, catalog, extra_plugins=selection.plugins,
                           only=selection.only)
    for note in resolved.notes:
        sys.stderr.write(f"harness plugins: note: {note}.\n")
    width = max((len(n) for n in [*catalog.entries, *resolved.enabled]), default=8)
    for name in [*resolved.enabled, *(n for n in catalog.entries if n not in resolved.enabled)]:
        source = catalog.entries[name].source if name in catalog.entries else "path"
        print(f"{name:<{width}}  {'on ' if name in resolved.enabled else 'off'}  {source:<10}  "
              f"{catalog.entries[name].description if name in catalog.entries else ''}".rstrip())
    inherited = f" (with {', '.join(selection.from_env)} from the environment)" if selection.from_env else ""
    print(f"{len(resolved.enabled)} of {len(catalog.entries)} plugins on, for {resolved.source}{inherited}")
    return 0


def _quiet(args: argparse.Namespace) -> None:
    """``--quiet``: no live console lines from this process and the processes it starts (HARNESS_QUIET=1)."""
    if getattr(args, "quiet", False):
        from harness.core.console import QUIET_ENV

        os.environ[QUIET_ENV] = "1"


def _cmd_run(args: argparse.Namespace) -> int:
    from harness.stages.runner import run_stage

    _quiet(args)

    resume: str | bool | None = args.resume
    if resume == "":
        resume = True
    return run_stage(args.stage, args.config, resume=resume)


def _cmd_demo(args: argparse.Namespace) -> int:
    from harness.stages.demo import run_demo

    _quiet(args)

    return run_demo(args.out)


def _cmd_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.tools.replay import print_replay

    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    return print_replay(Path(args.capture_dir), checkpoint, args.rank, args.device, args.tolerance)


def _scan_option_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the numeric options of ``harness scan`` (checked before any work: exit 1 means dirty)."""
    problems = []
    for flag, value in (("-n", args.n), ("--workers", args.workers)):
        if value < 1:
            problems.append(f"{flag} {value} is under 1. Fix: pass a whole number of 1 or more.")
    for flag, value in (("--dirty-fraction", args.dirty_fraction), ("--partial-fraction", args.partial_fraction),
                        ("--near-dup-threshold", args.near_dup_threshold)):
        if not 0.0 <= value <= 1.0:
            problems.append(f"{flag} {value} is not a fraction. Fix: pass a number from 0 to 1.")
    if args.dirty_fraction <= 0.0:
        problems.append("--dirty-fraction 0 would call every example dirty. Fix: pass a fraction above 0 (default 0.5).")
    elif args.partial_fraction >= args.dirty_fraction and 0.0 <= args.partial_fraction <= 1.0:
        problems.append(f"--partial-fraction {args.partial_fraction} is not below --dirty-fraction {args.dirty_fraction}, "
                        "so no example could be partial. Fix: pass a partial fraction under the dirty one.")
    if args.template_min_examples < 0:
        problems.append(f"--template-min-examples {args.template_min_examples} is negative. Fix: pass 0 (keep every n-gram) or more.")
    for flag, value in (("--mask-margin", args.mask_margin), ("--max-spans", args.max_spans)):
        if value is not None and value < 0:
            problems.append(f"{flag} {value} is negative. Fix: pass a count of 0 or more.")
    return problems


def _cmd_scan(args: argparse.Namespace) -> int:
    from harness.tools.scan import ScanOptions, print_scan

    options = ScanOptions(n=args.n, dirty_fraction=args.dirty_fraction, partial_fraction=args.partial_fraction,
                          template_min_examples=args.template_min_examples, near_dup=args.near_dup,
                          near_dup_threshold=args.near_dup_threshold, scale_to_text=not args.no_scale_to_text)
    clean = None
    from harness.lib.documents import ScanError

    given = [flag for flag, on in (("--mask-spans", args.mask_spans), ("--force", args.force),
                                   ("--mask-margin", args.mask_margin is not None), ("--max-spans", args.max_spans is not None)) if on]
    if given and not args.write_clean:
        raise ScanError(f"harness scan: {', '.join(given)} only apply with --write-clean DIR, which was not given. "
                        "Fix: add --write-clean DIR, or drop those options.")
    problems = _scan_option_problems(args)
    if problems:
        raise ScanError("harness scan: " + " ".join(problems))
    args.mask_margin = 200 if args.mask_margin is None else args.mask_margin
    args.max_spans = 10 if args.max_spans is None else args.max_spans
    if args.write_clean:
        from pathlib import Path

        from harness.tools.decontaminate import CleanOptions

        clean = CleanOptions(Path(args.write_clean), mask_spans=args.mask_spans, margin=args.mask_margin,
                             max_spans=args.max_spans, force=args.force)
    return print_scan(args.train, args.eval, args.field, args.tokenizer, args.out, args.workers, options, args.id_field,
                      args.eval_field, clean=clean)


def _cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.tools.report import print_report

    return print_report(Path(args.output_dir), plots=not args.no_plots, out=Path(args.out) if args.out else None)


def _cmd_explain(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.tools.explain import print_explain

    return print_explain(Path(args.output_dir))


def _cmd_resume_point(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.tools.resume_point import print_resume_point

    return print_resume_point(Path(args.output_dir))


def _cmd_playbook(args: argparse.Namespace) -> int:
    from harness.tools.explain import print_playbook

    return print_playbook(args.key)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from harness.tools.estimate import print_estimate

    return print_estimate(args.params, args.tokens, args.devices, args.peak_tflops, args.device, args.mfu, args.zero,
                          args.precision, args.from_config)


def _installed_version() -> str:
    """The installed package's version (train-harness), without importing the harness."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{version('train-harness')} (train-harness)"
    except PackageNotFoundError:
        return "(train-harness, not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness", description="Monitoring and diagnostics harness around the Hugging Face Trainer."
    )
    parser.add_argument("--version", action="version", version=f"harness {_installed_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    wrap = sub.add_parser(
        "wrap",
        help="run an unmodified training command with the harness attached to every Trainer",
        description="Run COMMAND (python, torchrun, deepspeed, accelerate launch ...) with the harness attached "
        "to every transformers.Trainer it trains. The exit status of COMMAND is returned, except that it is 75 when the "
        "harness stopped training and COMMAND exited 0 anyway (or 1 from an uncaught harness.HarnessStopped); any other "
        "status of COMMAND is kept. A bad config exits 2 before COMMAND starts.",
    )
    wrap.add_argument("--config", help="harness YAML config (default: built-in defaults)")
    wrap.add_argument("--plugins", help="comma-separated plugins to enable in addition to the config's (the defaults included)")
    wrap.add_argument("--only", help="comma-separated plugins to enable, exactly those and none of the defaults "
                      "(wins over the config's 'plugins' and 'only'; `harness plugins --only ...` shows the result)")
    wrap.add_argument("--quiet", action="store_true", help=QUIET_HELP + "; and no closing summary")
    wrap.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the training command")
    wrap.set_defaults(func=_cmd_wrap)

    run = sub.add_parser(
        "run",
        help="run a training stage (pretrain, continue, sft, dpo) from one YAML config, with the harness attached",
        description="Build model, tokenizer, data and the Trainer/TRL trainer from the config and train with the harness "
        "attached (the mlflow plugin on). Works under torchrun and with a deepspeed section.",
    )
    run.add_argument("stage", choices=["pretrain", "continue", "sft", "dpo"])
    run.add_argument("--config", required=True, help="the run config YAML (see examples/*.yaml)")
    run.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT", help="resume from CKPT, or the last checkpoint")
    run.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    run.set_defaults(func=_cmd_run)

    demo = sub.add_parser(
        "demo",
        help="the embedded default: train a tiny model with faults injected on purpose, show what the harness found",
    )
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    demo.set_defaults(func=_cmd_demo)

    replay = sub.add_parser(
        "replay",
        help="recompute the per-sample losses of a captured batch on a checkpoint and compare them with the capture",
        description="Load CAPTURE_DIR (<output_dir>/harness/captures/step-<N>/), the checkpoint of the step before it "
        "(or --checkpoint), restore the RNG and rerun the forward pass: prints per-sample losses, most suspect first. "
        "Exit status 1 when the captured numbers are not reproduced on the capture's own checkpoint.",
    )
    replay.add_argument("capture_dir", help="a captures/step-<N> directory")
    replay.add_argument("--checkpoint", help="checkpoint or model directory (default: checkpoint-<N-1> of the run)")
    replay.add_argument("--rank", type=int, default=None, help="which rank's capture (default: the lowest present)")
    replay.add_argument("--device", default=None, help="device for the forward pass (default: the capture's, cpu when it is not here)")
    replay.add_argument(
        "--tolerance", type=float, default=None,
        help="max |diff| that counts as reproduced (default: 1e-4 in fp32, 2e-2 under bf16/fp16)",
    )
    replay.set_defaults(func=_cmd_replay)

    scan = sub.add_parser(
        "scan",
        help="find eval examples in training data (n-gram overlap, before training)",
        description="Index the eval sets' n-grams, stream the training data through them and write, per eval example, "
        "the matched fraction, coverage, longest matched span, training documents hit and a status (clean/partial/dirty).",
    )
    scan.add_argument("--train", nargs="+", required=True, metavar="PATH", help=".txt (a document per line), .jsonl, .parquet files, folders of them, or `datasets` folders")
    scan.add_argument("--eval", nargs="+", required=True, metavar="PATH", help="eval sets, in the same formats (one example per line/record)")
    scan.add_argument("--field", default="text", help="the text field of .jsonl/.parquet/datasets records (default: text)")
    scan.add_argument("--eval-field", default=None, help="the eval sets' text field when it differs from --field")
    scan.add_argument("--id-field", default="id", help="the id field when records have one (default: id; else file:line)")
    scan.add_argument("--tokenizer", default=None, metavar="DIR", help="compare token ids of this tokenizer (default: normalised words)")
    scan.add_argument("--out", default="contamination", metavar="DIR", help="where the report and id lists go (default: contamination)")
    scan.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes scanning the training data (default: cpu count)")
    scan.add_argument("-n", type=int, default=13, help="n-gram length in words or tokens (default: 13)")
    scan.add_argument("--no-scale-to-text", action="store_true",
                      help="with --tokenizer: count -n in tokens as given (by default -n and the dirty span are scaled up when "
                      "the tokenizer holds fewer than about 3.2 characters of eval text per token, to about the text 13 tokens "
                      "of a usual tokenizer hold)")
    scan.add_argument("--dirty-fraction", type=float, default=0.5, help="dirty from this matched fraction of an example's n-grams (default: 0.5)")
    scan.add_argument("--partial-fraction", type=float, default=0.0, help="partial above this matched fraction (default: 0: any match)")
    scan.add_argument("--template-min-examples", type=int, default=10, help="leave out n-grams shared by this many eval examples (templates; default 10, 0 keeps all)")
    scan.add_argument("--near-dup", action="store_true", help="also find training documents that are lightly edited copies of an eval example (MinHash LSH over word 5-grams, confirmed by exact Jaccard)")
    scan.add_argument("--near-dup-threshold", type=float, default=0.8, help="Jaccard similarity of a near duplicate (default: 0.8)")
    scan.add_argument("--write-clean", metavar="DIR", default=None,
                      help="also write the training data without the documents that match a dirty eval example to DIR/train "
                      "(same formats and layout; `datasets` folders as JSON lines), each eval set split into DIR/eval/<name>.clean.<ext> "
                      "and .dirty.<ext>, and what was removed to DIR/decontamination.md/.json")
    scan.add_argument("--mask-spans", action="store_true",
                      help="with --write-clean: cut the matched spans out of a document (with --mask-margin) instead of dropping it")
    scan.add_argument("--mask-margin", type=int, default=None, metavar="N",
                      help="characters cut on each side of a matched span, widened to whole words (default: 200, as lm-eval's janitor)")
    scan.add_argument("--max-spans", type=int, default=None, metavar="N",
                      help="with --mask-spans: a document needing more cuts than this is dropped whole (default: 10)")
    scan.add_argument("--force", action="store_true", help="write into a non-empty --write-clean DIR (its train/ and eval/ are replaced)")
    scan.set_defaults(func=_cmd_scan)

    report = sub.add_parser(
        "report",
        help="rebuild report.md and report.html of a run from its run directory alone (also after kill -9)",
        description="Rebuild <output_dir>/harness/report.md and report.html from the files the harness wrote during the run "
        "(findings, step records, run.json, evidence). Runs nested below OUTPUT_DIR (the demo's) are rebuilt too.",
    )
    report.add_argument("output_dir", help="the training run's output_dir (the folder holding harness/)")
    report.add_argument("--no-plots", action="store_true", help="skip the plots (faster; the tables stay)")
    report.add_argument("--out", metavar="DIR", default=None,
                        help="write report.md, report.html and report/ under DIR instead of the run directory (a read-only run); "
                        "the run directory is left untouched")
    report.set_defaults(func=_cmd_report)

    explain = sub.add_parser(
        "explain",
        help="print a run's verdict and, for each finding, the next step from its playbook",
        description="Read OUTPUT_DIR's run directory and print the verdict, then each finding code with its numbers and the "
        "first confirm step of its playbook section. Runs nested below OUTPUT_DIR are explained too.",
    )
    explain.add_argument("output_dir", help="the training run's output_dir (the folder holding harness/)")
    explain.set_defaults(func=_cmd_explain)

    resume_point = sub.add_parser(
        "resume-point",
        help="print the newest proven checkpoint of a run (exit 1 when there is none)",
        description="Print the newest checkpoint-<N> of OUTPUT_DIR that checkpoint_proof read back and marked harness_proven "
        "(complete, weights load and are finite, the reference loss matches); exit 1, with a line on stderr, when none is.",
    )
    resume_point.add_argument("output_dir", help="the training run's output_dir (the folder holding the checkpoint-* folders)")
    resume_point.set_defaults(func=_cmd_resume_point)

    playbook = sub.add_parser(
        "playbook",
        help="list the troubleshooting playbooks, or print one (a finding code's section, or a topic such as oom)",
    )
    playbook.add_argument("key", nargs="?", default=None, metavar="CODE|TOPIC", help="a finding code or a playbook name; none lists them")
    playbook.set_defaults(func=_cmd_playbook)

    estimate = sub.add_parser(
        "estimate",
        help="compute (C = 6ND), time and memory per device of a planned run, before spending it",
        description="The formulas of the run card: C = 6 x parameters x tokens; time = C / (devices x peak x MFU); memory per "
        "device for weights, gradients and Adam state under the precision and ZeRO stage (activations not included).",
    )
    estimate.add_argument("--params", type=float, help="parameters, e.g. 7e9")
    estimate.add_argument("--tokens", type=float, help="training tokens, e.g. 1e12")
    estimate.add_argument("--devices", type=int, default=1, help="data-parallel devices (default 1)")
    estimate.add_argument("--peak-tflops", type=float, default=None, help="dense 16-bit peak per device in TFLOPS, e.g. 989 (H100)")
    estimate.add_argument("--device", default=None, help="take the peak from a device name instead (H100, A100, ...)")
    estimate.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation, a fraction of the peak (default 0.4)")
    estimate.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None, help="DeepSpeed ZeRO stage (default 0, or the config's)")
    estimate.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None, help="training precision (default bf16, or the config's)")
    estimate.add_argument("--from-config", metavar="RUN_YAML", default=None,
                          help="read parameters, tokens, precision and ZeRO stage from a `harness run` stage config")
    estimate.set_defaults(func=_cmd_estimate)

    plugins = sub.add_parser("plugins", help="list available plugins, their options or their finding codes")
    plugins.add_argument("--config-reference", action="store_true", help="print every config option with type, default and description")
    plugins.add_argument("--codes", action="store_true", help="print every finding code with severity and owner")
    plugins.add_argument("--config", help="show which plugins a run with this harness YAML config enables (on/off)")
    plugins.add_argument("--plugins", help="with --config: as `harness wrap --plugins` (added to the config's)")
    plugins.add_argument("--only", help="with --config: as `harness wrap --only` (exactly these)")
    plugins.set_defaults(func=_cmd_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from harness.core.offline import apply as network_opt_outs

    network_opt_outs(args.cmd)  # before any command imports mlflow, datasets or transformers
    try:
        return int(args.func(args))
    except HarnessStopped as exc:  # a stage runner under `on_stop: raise`: the harness stopped training
        sys.stderr.write(f"harness: {exc}\n")
        return EXIT_STOPPED
    except HarnessError as exc:
        sys.stderr.write(f"harness: {exc}\n")
        return 2
    except BrokenPipeError:  # `harness explain run | head`: the reader left; not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

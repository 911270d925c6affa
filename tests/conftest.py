"""Shared fixtures: a tiny real Llama, a local tokenizer and data, and real Trainers (no hub, no mocks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import yaml

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
    "HARNESS_REPORT_PLOTS": "0",  # a second of matplotlib per run end; the report's own tests and the demo turn plots on
}.items():
    os.environ.setdefault(_key, _value)
for _key in ("HARNESS_CONFIG", "HARNESS_PLUGINS", "HARNESS_ONLY", "HARNESS_WRAP"):
    os.environ.pop(_key, None)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_trainer.py"
FAULTS = "harness.testing:FaultInjector"
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from harness.lib.tiny import corpus_lines, train_tokenizer

    return train_tokenizer(corpus_lines(), vocab_size=256)


@pytest.fixture(scope="session")
def lm_rows(tokenizer: Any) -> Any:
    from harness.lib.tiny import lm_dataset

    return lm_dataset(tokenizer, seq_len=32, n_rows=96)


@pytest.fixture(scope="session")
def repetitive_rows(tokenizer: Any) -> Any:
    """Rows cut from four corpus lines only: a corpus the tiny model learns fast, so a bad batch stands out."""
    from harness.lib.tiny import corpus_lines, lm_dataset

    return lm_dataset(tokenizer, seq_len=32, n_rows=96, lines=corpus_lines()[:4])


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MB tmpfs mounted at ``tmp_path/tmpfs`` (a disk a test may fill); skipped where mounting is not allowed."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and mount(8) are needed): {done.stderr.strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def make_trainer(tmp_path: Path, tokenizer: Any, lm_rows: Any) -> Callable[..., Any]:
    """A real ``transformers.Trainer`` on a 2-layer Llama (or ``model``); other keyword arguments go to TrainingArguments."""
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny import build_tiny_llama

    def factory(
        output_dir: Path | None = None,
        callbacks: list[Any] | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        model: Any = None,
        data_collator: Any = None,
        eval_dataset: Any = None,
        **overrides: Any,
    ) -> Any:
        settings: dict[str, Any] = dict(
            output_dir=str(output_dir or tmp_path / "out"),
            max_steps=6,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            report_to="none",
            logging_steps=1,
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        settings.update(overrides)
        return Trainer(
            model=build_tiny_llama(tokenizer, seed=0) if model is None else model,
            args=TrainingArguments(**settings),
            train_dataset=lm_rows if train_dataset is None else train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            data_collator=data_collator,
            eval_dataset=eval_dataset,
        )

    return factory


class RankZeroCtx:
    """The little of a plugin context that rank 0's grad_sync comparison uses: its findings and its run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.is_main, self.run_dir, self.findings = True, run_dir, []

    def report(self, code: str, message: str, **kwargs: Any) -> Any:
        self.findings.append({"code": code, "message": message, **kwargs})

    def path(self, name: str) -> Path:
        return self.run_dir / name


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def findings_of(output_dir: Path, code: str | None = None) -> list[dict[str, Any]]:
    rows = read_jsonl(Path(output_dir) / "harness" / "findings.jsonl")
    return [r for r in rows if code is None or r["code"] == code]


def harness_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run the installed ``harness`` command line as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd
    )


def wrapped_example(
    out: Path, config: Path, *extra: str, launcher: list[str] | None = None, steps: int = 14, save_steps: int = 5
) -> subprocess.CompletedProcess[str]:
    """The unmodified example script under ``harness wrap`` (python, or ``launcher`` such as torchrun)."""
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", str(steps), "--save_steps", str(save_steps), *extra]
    return harness_cli("wrap", "--config", str(config), "--", *(launcher or [sys.executable]), *script, env={"DS_ACCELERATOR": "cpu"})


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(nproc: int = 2) -> list[str]:
    """A torchrun command line on a free local port (port 0 makes the ranks disagree)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def broken_report_links(run_dir: Path) -> list[str]:
    """Every link of a run's report.md, report.html and the playbooks copied beside them that does not resolve.

    Relative file links must name an existing file; ``file.md#anchor`` needs a
    ``#``-heading with that anchor (GitHub's slug) in the file; ``#id`` in the
    HTML needs an element with that id. External links are errors: reports
    are read offline.
    """
    import re
    from html.parser import HTMLParser
    from urllib.parse import unquote

    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    def anchors_of(path: Path) -> set[str]:
        return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)}

    broken: list[str] = []

    def check(source: Path, target: str, ids: set[str] | None = None) -> None:
        if target.startswith(("http:", "https:", "//")):
            broken.append(f"{source.name}: external link {target}")
            return
        if target.startswith("data:"):
            return
        path, _, anchor = unquote(target).partition("#")
        if not path:
            if ids is None or anchor not in ids:
                broken.append(f"{source.name}: #{anchor} has no element")
            return
        resolved = (source.parent / path).resolve()
        if not resolved.is_file():
            broken.append(f"{source.name}: {path} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{source.name}: {path}#{anchor} has no such heading")

    markdown_files = [run_dir / "report.md", *sorted((run_dir / "report" / "playbooks").glob("*.md"))]
    for source in markdown_files:
        text = re.sub(r"`[^`\n]*`", "", source.read_text(encoding="utf-8"))  # code spans hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            check(source, target)

    class Links(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.ids: set[str] = set()
            self.targets: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            values = dict(attrs)
            if values.get("id"):
                self.ids.add(str(values["id"]))
            for key in ("href", "src"):
                if values.get(key):
                    self.targets.append(str(values[key]))

    html = run_dir / "report.html"
    parser = Links()
    parser.feed(html.read_text(encoding="utf-8"))
    for target in parser.targets:
        check(html, target, parser.ids)
    return broken


def example_config(name: str, tmp_path: Path, training: dict[str, Any] | None = None, **top: Any) -> Path:
    """The example config, with its output in tmp_path and its data paths made absolute."""
    data = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    data["output_dir"] = str(tmp_path / name)
    for key in ("sources", "old_sources"):
        for source in data["data"].get(key, []):
            source["path"] = str((EXAMPLES / source["path"]).resolve())
    data["training"].update(training or {})
    tmp_path.mkdir(parents=True, exist_ok=True)
    data.update(top)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path

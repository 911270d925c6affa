"""data_hash: the ledger of every micro-batch, and the data faults of broken resumes, duplicates and unsharded ranks."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Trainer

import harness
from conftest import EXAMPLES, findings_of, harness_cli, read_jsonl, torchrun, wrapped_example, write_yaml
from harness.lib.hashing import device_row_hashes, hex64
from harness.lib.ledger import read_ledger

DATA_CODES = ("DATA_REPEATED", "DATA_SKIPPED", "DUPLICATE_SAMPLES", "RANK_DATA_OVERLAP", "RESUME_DATA_CHANGED")


def _data_findings(output_dir: Any) -> list[tuple[str, int]]:
    return [(f["code"], f["step"]) for f in findings_of(output_dir) if f["code"] in DATA_CODES]


def _dataset_hashes(rows: Any) -> set[str]:
    return {hex64(h) for h in device_row_hashes(torch.tensor(rows["input_ids"])).tolist()}


def test_the_ledger_holds_every_micro_batch_and_reads_back(make_trainer: Any, lm_rows: Any) -> None:
    trainer = make_trainer(max_steps=15, gradient_accumulation_steps=2)  # 96 rows / 8 per step: epoch 1 from step 13
    harness.attach(trainer)
    trainer.train()
    ledger = read_ledger(trainer.args.output_dir)
    assert len(ledger) == 15 * 2 * 4 and list(ledger["attempt"].unique()) == [1]
    assert sorted(ledger["step"].unique()) == list(range(1, 16)) and sorted(ledger["micro_batch"].unique()) == [0, 1]
    assert set(ledger["sample_hash"]) <= _dataset_hashes(lm_rows)  # hashed on the batch = hashed from the dataset
    assert ledger.groupby("step")["epoch"].first().to_dict() == {s: (0 if s <= 12 else 1) for s in range(1, 16)}
    assert ledger[ledger["epoch"] == 0]["sample_hash"].is_unique and not ledger["superseded"].any()
    assert _data_findings(trainer.args.output_dir) == []  # a new epoch may see its samples again


def _interrupted_then_resumed(make_trainer: Any, out: Path, policy: dict[str, str] | None = None, **resume_args: Any) -> Any:
    """A run that got to step 20 (checkpoints every 5), resumed from checkpoint-10 as if it had died at 20."""
    first = make_trainer(output_dir=out, max_steps=20, save_strategy="steps", save_steps=5)
    harness.attach(first)
    first.train()
    shutil.rmtree(out / "checkpoint-15")
    shutil.rmtree(out / "checkpoint-20")
    resumed = make_trainer(output_dir=out, max_steps=20, save_strategy="steps", save_steps=5, **resume_args)
    harness.attach(resumed, config={"policy": {"RESUME_DATA_POSITION": "continue", **(policy or {})}})  # data_hash's view alone
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    return resumed


def test_a_correct_resume_is_silent_and_the_ledger_marks_the_lost_steps(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted_then_resumed(make_trainer, out)
    assert _data_findings(out) == []
    ledger = read_ledger(out)
    lost = ledger[ledger["superseded"]]
    assert set(lost["attempt"]) == {1} and sorted(lost["step"].unique()) == list(range(11, 21))
    first, second = (ledger[(ledger["attempt"] == a) & (ledger["step"] > 10)] for a in (1, 2))
    assert list(first["sample_hash"]) == list(second["sample_hash"])  # the resumed run trained exactly what was lost


def test_ignore_data_skip_repeats_the_epoch_and_skips_what_came_next(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted_then_resumed(make_trainer, out, ignore_data_skip=True)
    repeated = findings_of(out, "DATA_REPEATED")
    assert repeated[0]["step"] == 11 and repeated[0]["evidence"]["rows"] == [0, 1, 2, 3]
    assert "follows a resume" in repeated[0]["message"]
    (skipped,) = findings_of(out, "DATA_SKIPPED")
    assert skipped["evidence"]["missing"] == 40 and skipped["evidence"]["steps"] == list(range(11, 21))


def _masked_lm_trainer(make_trainer: Any, tokenizer: Any, lm_rows: Any, out: Path, **args: Any) -> Any:
    """A tiny BERT masked LM on the LM rows, masked by transformers' collator (no seed: new masks at every collation)."""
    from copy import deepcopy

    from transformers import DataCollatorForLanguageModeling

    from harness.lib.tiny_zoo import build_tiny_model

    tok = deepcopy(tokenizer)
    tok.add_special_tokens({"mask_token": "<mask>"})
    return make_trainer(output_dir=out, model=build_tiny_model("bert", tok, "masked_lm"), train_dataset=lm_rows.remove_columns(["labels"]),
                        data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.3), processing_class=tok,
                        max_steps=20, save_strategy="steps", save_steps=5, **args)


def _interrupted_masked_lm(make_trainer: Any, tokenizer: Any, lm_rows: Any, out: Path, **resume_args: Any) -> Any:
    first = _masked_lm_trainer(make_trainer, tokenizer, lm_rows, out)
    harness.attach(first)
    first.train()
    for step in (15, 20):
        shutil.rmtree(out / f"checkpoint-{step}")
    resumed = _masked_lm_trainer(make_trainer, tokenizer, lm_rows, out, **resume_args)
    harness.attach(resumed, config={"policy": {"RESUME_DATA_POSITION": "continue"}} if resume_args else None)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    return resumed


def test_a_masked_lm_resume_is_silent_because_samples_are_hashed_from_their_original_tokens(
        make_trainer: Any, tokenizer: Any, lm_rows: Any, tmp_path: Path) -> None:
    """Issue 43 trial: the masked-LM collator draws new [MASK] and random tokens at every collation, so hashing the
    batch's input_ids gave one sample another hash on every pass: a correct resume was stopped by RESUME_DATA_POSITION
    (exit 75) and DATA_REPEATED was blind. The ledger now holds the dataset rows' own hashes (the labels' originals
    put back), the resumed run trains exactly what was lost, and nothing is reported (the policy is the default: stop)."""
    out = tmp_path / "run"
    resumed = _interrupted_masked_lm(make_trainer, tokenizer, lm_rows, out)
    assert resumed.state.global_step == 20
    assert [f for f in findings_of(out) if f["code"] in DATA_CODES or f["code"].startswith("RESUME_")] == []
    ledger = read_ledger(out)
    assert set(ledger["sample_hash"]) <= _dataset_hashes(lm_rows)
    first, second = (ledger[(ledger["attempt"] == a) & (ledger["step"] > 10)] for a in (1, 2))
    assert len(first) == 40 and list(first["sample_hash"]) == list(second["sample_hash"])


def test_a_masked_lm_resume_that_restarts_the_epoch_is_data_repeated(make_trainer: Any, tokenizer: Any, lm_rows: Any, tmp_path: Path) -> None:
    """The same run resumed with ignore_data_skip: the restarted epoch's samples are found repeated at the first step
    after the resume (with the masked input_ids hashed, no sample ever hashed alike twice)."""
    out = tmp_path / "run"
    _interrupted_masked_lm(make_trainer, tokenizer, lm_rows, out, ignore_data_skip=True)
    repeated = findings_of(out, "DATA_REPEATED")
    assert repeated and repeated[0]["step"] == 11 and "follows a resume" in repeated[0]["message"]


def test_an_action_tied_to_data_repeated_comes_at_the_step_of_the_repeat(make_trainer: Any, tmp_path: Path) -> None:
    """Repeats are checked in groups of CHECK_EVERY micro-batches, unless the policy acts on them: then at every step."""
    out = tmp_path / "run"
    resumed = _interrupted_then_resumed(make_trainer, out, policy={"DATA_REPEATED": "stop"}, ignore_data_skip=True)
    repeated = findings_of(out, "DATA_REPEATED")
    assert repeated[0]["step"] == 11 and repeated[0]["action"] == "stop"
    assert resumed.state.global_step == 11  # stopped at the repeat, not at the next group check or the run end


def test_duplicate_rows_are_reported_once_and_may_recur_within_an_epoch(make_trainer: Any, repetitive_rows: Any) -> None:
    distinct = len(set(map(tuple, repetitive_rows["input_ids"])))
    trainer = make_trainer(max_steps=30, train_dataset=repetitive_rows, save_strategy="steps", save_steps=30)
    harness.attach(trainer)
    trainer.train()
    (dup,) = findings_of(trainer.args.output_dir, "DUPLICATE_SAMPLES")
    assert dup["evidence"]["extra_copies"] == len(repetitive_rows) - distinct and dup["evidence"]["source"] == "dataset index"
    assert findings_of(trainer.args.output_dir, "DATA_REPEATED") == []  # each copy may be trained once per epoch
    # a resume in the same run directory trains the same dataset: its duplicates were said, once is enough
    again = make_trainer(max_steps=32, train_dataset=repetitive_rows, output_dir=trainer.args.output_dir)
    harness.attach(again)
    again.train(resume_from_checkpoint=True)
    assert len(findings_of(trainer.args.output_dir, "DUPLICATE_SAMPLES")) == 1


def test_changed_training_data_on_resume(make_trainer: Any, lm_rows: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = make_trainer(output_dir=out, max_steps=5, save_strategy="steps", save_steps=5)
    harness.attach(first)
    first.train()
    resumed = make_trainer(output_dir=out, max_steps=8, train_dataset=lm_rows.select(range(48)))
    harness.attach(resumed)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    (changed,) = findings_of(out, "RESUME_DATA_CHANGED")
    assert changed["evidence"]["stored"]["rows"] == 96 and changed["evidence"]["current"]["rows"] == 48


@pytest.mark.slow
def test_two_ranks_reading_the_same_stream_overlap(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults"]})
    # the ranks are compared at every step: step 1 already shows the overlap (no checkpoints: nothing here needs one)
    result = wrapped_example(out, config, "--own_dataloader", launcher=torchrun(), steps=4, save_steps=0)
    assert result.returncode == 0, result.stderr[-3000:]
    overlap = findings_of(out, "RANK_DATA_OVERLAP")
    assert overlap[0]["step"] == 1 and overlap[0]["evidence"]["ranks"] == [0, 1] and overlap[0]["evidence"]["shared_samples"] == 4
    # The negative case, two ranks on the Trainer's own sharded loader finding no overlap, is the clean 200-step DDP run of
    # tests/plugins/test_grad_sync.py::test_clean_two_process_run_of_200_steps_is_silent (default plugins: no data finding).


def test_a_checkpoint_stores_the_epoch_of_its_own_step_though_repeats_are_checked_in_groups(make_trainer: Any) -> None:
    """Repeats are checked every CHECK_EVERY micro-batches; a save checks what is pending first, so its state is current."""
    import json

    from harness.plugins.data_hash import CHECK_EVERY

    trainer = make_trainer(max_steps=15, gradient_accumulation_steps=2, save_strategy="steps", save_steps=14)  # epoch 1 from 13
    assert 14 * 2 % CHECK_EVERY  # the save lands between two group checks
    harness.attach(trainer)
    trainer.train()
    state = json.loads((Path(trainer.args.output_dir) / "checkpoint-14" / "harness_state" / "rank-0.json").read_text())
    assert state["data_hash"]["epoch"] == 1
    assert _data_findings(trainer.args.output_dir) == []


def test_a_check_that_raises_still_leaves_the_ledger_closed_and_whole(make_trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's error is isolated; the ledger is still closed at the run end (trimmed, every step in it)."""
    from harness.plugins.data_hash import DataHash

    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("a broken repeat check")

    monkeypatch.setattr(DataHash, "_check_samples", broken)
    trainer = make_trainer(max_steps=20)
    harness.attach(trainer)
    trainer.train()
    assert trainer.state.global_step == 20
    assert any("a broken repeat check" in f["message"] for f in findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR"))
    raw = (Path(trainer.args.output_dir) / "harness" / "ledger" / "rank-0.jsonl").read_bytes()
    assert b"\0" not in raw and raw.endswith(b"\n")
    assert sorted(read_ledger(trainer.args.output_dir)["step"].unique()) == list(range(1, 21))


@pytest.mark.slow
@pytest.mark.parametrize("resumed", [False, True])
def test_a_step_whose_hashes_are_lost_on_one_rank_leaves_the_epochs_padded_end_known(tmp_path: Path, resumed: bool) -> None:
    """Two ranks on a dataset whose epoch (9 steps) ends in the sampler's padding; rank 1 loses step 6's hashes to an error.

    The padded last batch repeats samples from the epoch's start, which data_hash lets pass by its position in the epoch.
    Before: that position counted only the micro-batches whose hashes were read, so after the lost step rank 1 put its last
    batch 4 samples too early and reported the padding as DATA_REPEATED at step 9. ``resumed``: the run stops at a save at
    step 8 and a second run resumes from it; the position comes back from the checkpoint (the ledger, which a resume also
    reads, lacks the lost step's lines).
    """
    data, out = tmp_path / "data", tmp_path / "run"
    subprocess.run([sys.executable, str(EXAMPLES / "clm_data.py"), "--out", str(data)], check=True, capture_output=True)
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["defaults", "harness.testing:FaultInjector"],
        "fault_injector": {"break_methods": ["data_hash._read_hashes"], "break_on_rank": 1, "break_at_step": 6},
    })

    def run(steps: int, save_steps: int) -> Any:
        result = harness_cli(
            "wrap", "--config", str(config), "--", *torchrun(), str(EXAMPLES / "run_clm.py"),
            "--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt"), "--do_train",
            "--output_dir", str(out), "--max_steps", str(steps), "--per_device_train_batch_size", "4", "--logging_steps", "1",
            "--use_cpu", "--report_to", "none", "--save_steps", str(save_steps),
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    if resumed:
        run(8, 8)
        assert (out / "checkpoint-8").is_dir()
    result = run(12, 0 if not resumed else 100)  # run_clm resumes from the output directory's last checkpoint
    if resumed:
        attempts = json.loads((out / "harness" / "run.json").read_text())["attempts"]
        assert len(attempts) == 2 and str(attempts[1]["resumed_from"]).endswith("checkpoint-8"), attempts
    errors = [(f["plugin"], f["rank"], f["step"]) for f in findings_of(out, "INTERNAL_PLUGIN_ERROR")]
    assert errors == [("data_hash", 1, 6), ("data_hash", 1, 6)]  # the guard's read, then the step end's
    steps = {r["step"] for r in read_jsonl(out / "harness" / "ledger" / "rank-1.jsonl") if r.get("event") is None}
    assert steps == set(range(1, 13)) - {6}
    # the run does end its epoch in padding, on both ranks, and both let it pass
    for rank in (0, 1):
        assert f"of the last batch of epoch 0 on rank {rank} were trained earlier in the epoch" in result.stdout + result.stderr, rank
    assert _data_findings(out) == []


class _RankCtx:
    """The part of a rank's run context data_hash uses, with a real StepExchange (``_meet`` plays the all-gather)."""

    def __init__(self, rank: int, world_size: int, run_dir: Path) -> None:
        from harness.core.exchange import StepExchange

        self.rank, self.world_size, self.is_main, self.run_dir = rank, world_size, rank == 0, run_dir
        self.resumed_from, self.options, self.manager, self.masked_lm = None, None, None, False
        self.exchange = StepExchange()
        self.reports: list[dict[str, Any]] = []

    def reserve(self, key: str, capacity: int, *, owner: str) -> None:
        self.exchange.reserve(owner, key, capacity)

    def share(self, key: str, values: Any, *, owner: str) -> None:
        self.exchange.share(owner, key, values)

    def shared(self, key: str, *, owner: str) -> Any:
        return self.exchange.received(owner, key)

    def shared_cut(self, key: str, *, owner: str) -> list[int]:
        return self.exchange.cut_ranks(owner, key)

    def deferred(self, key: str, *, owner: str) -> list[Any]:
        return []  # no micro-batch was hashed in these steps

    def report(self, code: str, message: str, **kwargs: Any) -> None:
        self.reports.append({"code": code, "message": message, **kwargs})


class _ShardingTrainer(SimpleNamespace):
    """A stand-in trainer whose loader is the Trainer's own (its sampler shards one dataset across the ranks)."""

    get_train_dataloader = Trainer.get_train_dataloader


def _ranks_compare_datasets(datasets: list[Any], tmp_path: Path, steps: int = 2) -> list[_RankCtx]:
    """data_hash on ``len(datasets)`` ranks, each inspecting its own training dataset, through ``steps`` optimizer steps."""

    from harness.plugins.data_hash import DataHash

    contexts, plugins = [], []
    for rank, dataset in enumerate(datasets):
        ctx, plugin = _RankCtx(rank, len(datasets), tmp_path / "harness"), DataHash()
        plugin.__dict__["ctx"] = ctx
        plugin.setup(ctx)
        trainer = _ShardingTrainer(args=SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1),
                                   state=SimpleNamespace(global_step=0, epoch=0.0), train_dataset=dataset)
        plugin.on_run_start(ctx=ctx, trainer=trainer)
        plugin.inspect_dataset(ctx=ctx, dataset=dataset, split="train")
        contexts.append(ctx)
        plugins.append(plugin)
    for step in range(1, steps + 1):
        for ctx, plugin in zip(contexts, plugins):
            plugin.on_before_optimizer_step(ctx=ctx, step=step)
        rows = [ctx.exchange.pack([0]) for ctx in contexts]  # the step guard's one all-gather
        for ctx in contexts:
            ctx.exchange.unpack(rows, 1)
        for ctx, plugin in zip(contexts, plugins):
            plugin.on_step_end(ctx=ctx, step=step)
    for ctx, plugin in zip(contexts, plugins):
        plugin.on_run_end(ctx=ctx)
    return contexts


def _differ(contexts: list[_RankCtx]) -> list[dict[str, Any]]:
    assert all(r["code"] != "RANK_DATASETS_DIFFER" for ctx in contexts[1:] for r in ctx.reports)  # rank 0 reports
    return [r for r in contexts[0].reports if r["code"] == "RANK_DATASETS_DIFFER"]


def test_ranks_holding_the_same_rows_in_another_order_are_named_at_the_first_step(lm_rows: Any, tmp_path: Path) -> None:
    contexts = _ranks_compare_datasets([lm_rows, lm_rows.shuffle(seed=1)], tmp_path, steps=3)
    (finding,) = _differ(contexts)  # once: the fingerprints ride the first step's exchange only
    assert finding["step"] == 1 and finding["evidence"]["differing_ranks"] == [1]
    assert finding["evidence"]["same_rows_other_order"] == [1]
    assert [g["ranks"] for g in finding["evidence"]["groups"]] == [[0], [1]] and {g["rows"] for g in finding["evidence"]["groups"]} == {96}
    assert "rank 1 holds 96 rows" in finding["message"] and "in another order" in finding["message"]
    assert "same dataset in the same order" in finding["message"] and "seed" in finding["message"]
    # later steps carry nothing in the dataset slot (the per-step cost stays that of the overlap check)
    assert contexts[0].exchange.received("data_hash", "dataset") is None


def test_ranks_holding_other_data_are_named_and_identical_ranks_are_silent(lm_rows: Any, tmp_path: Path) -> None:
    (finding,) = _differ(_ranks_compare_datasets([lm_rows, lm_rows, lm_rows.select(range(80))], tmp_path / "other"))
    assert finding["evidence"]["differing_ranks"] == [2] and finding["evidence"]["reference_ranks"] == [0, 1]
    assert finding["evidence"]["same_rows_other_order"] == []
    assert "ranks 0, 1 hold 96 rows" in finding["message"] and "rank 2 holds 80 rows" in finding["message"]
    assert _differ(_ranks_compare_datasets([lm_rows, lm_rows], tmp_path / "same")) == []


def test_the_dataset_comparison_leaves_out_ranks_without_a_fingerprint() -> None:
    from harness.plugins.data_hash import rank_datasets_finding

    assert rank_datasets_finding(1, [[96, 5, 7], [], None]) is None  # nothing to compare rank 0's with
    assert rank_datasets_finding(1, [[96, 5, 7], [96, 5, 7]]) is None
    message, evidence = rank_datasets_finding(4, [[96, 5, 7], None, [96, -3, 8]]) or ("", {})
    assert evidence["differing_ranks"] == [2] and evidence["ranks_not_compared"] == [1]
    assert evidence["same_rows_other_order"] == []  # another order-free sum: other rows, not another order
    assert "at step 4" in message and "rank 2 holds 96 rows (digest fffffffffffffffd)" in message


def test_the_ranks_datasets_are_compared_only_where_the_trainers_own_loader_shards_them() -> None:
    """A subclass that builds its own loader may hand each rank its own shard on purpose: RANK_DATASETS_DIFFER would be
    a false error there. The Trainer's own loader (and TRL's, which inherit it) splits one dataset by index."""
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    from harness.plugins.data_hash import _trainer_shards_the_dataset

    class OwnLoader(Trainer):
        def get_train_dataloader(self) -> DataLoader:  # type: ignore[override]
            raise NotImplementedError

    class Plain(Trainer):
        pass

    bare = [cls.__new__(cls) for cls in (Trainer, Plain, SFTTrainer, OwnLoader)]
    assert [_trainer_shards_the_dataset(t) for t in bare] == [True, True, True, False]


# -- DATA_REPEATED names the classic cause of repeats in runs of the loader's worker count (issue 43, item 7) ---------


class _RowStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The rows as a stream; ``sharded``: each DataLoader worker yields its own share (``get_worker_info()``)."""

    def __init__(self, rows: Any, sharded: bool) -> None:
        self.rows, self.sharded = rows, sharded

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info() if self.sharded else None
        start, every = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, len(self.rows), every):
            yield dict(self.rows[i])


@pytest.mark.parametrize("sharded", [False, True])
def test_an_iterable_dataset_read_by_two_unsharded_workers_is_named_as_the_cause(
    make_trainer: Any, lm_rows: Any, sharded: bool
) -> None:
    """Two loader workers each read the whole stream and the loader takes a batch from each in turn: every batch comes
    twice in a row. DATA_REPEATED said only "the loader is not covering its epoch once"; it names the unsharded
    IterableDataset now (and a stream that shards by get_worker_info() is silent)."""
    trainer = make_trainer(max_steps=4, train_dataset=_RowStream(lm_rows, sharded), dataloader_num_workers=2)
    harness.attach(trainer, config={"only": ["data_hash"]})
    trainer.train()
    repeated = findings_of(trainer.args.output_dir, "DATA_REPEATED")
    if sharded:
        assert repeated == []
        return
    assert [f["step"] for f in repeated] == [2, 4]  # the second batch of each worker pair: every row of it
    first = repeated[0]
    assert first["evidence"]["rows"] == [0, 1, 2, 3] and first["evidence"]["cause"] == "unsharded_iterable_workers"
    assert first["evidence"]["dataloader_num_workers"] == 2 and first["evidence"]["same_as_previous_micro_batches"] == 1
    assert "IterableDataset (_RowStream) read by 2 DataLoader workers without torch.utils.data.get_worker_info()" in first["message"]


def test_the_worker_cause_is_named_only_for_runs_within_the_worker_count_of_an_iterable_dataset() -> None:
    from harness.plugins.data_hash import unsharded_workers_cause

    assert unsharded_workers_cause(1, 2, "RowStream") is not None
    assert unsharded_workers_cause(2, 3, "RowStream") is not None
    assert unsharded_workers_cause(0, 2, "RowStream") is None  # an earlier batch came back, not the one just before
    assert unsharded_workers_cause(2, 2, "RowStream") is None  # longer runs than the workers: another cause
    assert unsharded_workers_cause(1, 0, "RowStream") is None and unsharded_workers_cause(1, 1, "RowStream") is None
    assert unsharded_workers_cause(1, 2, None) is None  # a map-style dataset: the sampler gives each worker its own indices


# -- DATA_SKIPPED where the step exchange cannot carry every row (review of issue 43, item 4) -------------------------


class _HashingRankCtx(_RankCtx):
    """``_RankCtx`` whose micro-batches are hashed: ``defer`` keeps the rows' hashes for the step's read, as the guard's."""

    def __init__(self, rank: int, world_size: int, run_dir: Path, trainer: Any) -> None:
        super().__init__(rank, world_size, run_dir)
        self.trainer, self.step, self._queued = trainer, 0, []

    def defer(self, key: str, tensor: Any, *, owner: str) -> None:
        self._queued.append(tensor.tolist())

    def deferred(self, key: str, *, owner: str) -> list[Any]:
        read, self._queued = self._queued, []
        return read


def _ranks_train(run_dir: Path, steps: range, resume_step: int | None, rows: int = 3) -> list[_HashingRankCtx]:
    """data_hash on 2 ranks, 2 rows per device (the exchange's slot), each micro-batch holding ``rows`` rows (packed or
    paired rows: more than the slot), trained over ``steps`` after ``resume_step`` (None: from the start)."""
    from harness.plugins.data_hash import DataHash

    contexts, plugins = [], []
    for rank in range(2):
        trainer = SimpleNamespace(args=SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1),
                                  state=SimpleNamespace(global_step=resume_step or 0, epoch=0.0), train_dataset=None)
        ctx, plugin = _HashingRankCtx(rank, 2, run_dir, trainer), DataHash()
        ctx.resumed_from = run_dir.parent / f"checkpoint-{resume_step}" if resume_step is not None else None
        ctx.step = resume_step or 0
        plugin.__dict__["ctx"] = ctx
        plugin.setup(ctx)
        plugin.on_run_start(ctx=ctx, trainer=trainer)
        if resume_step is not None:
            plugin.on_resume(ctx=ctx, state=None)
        contexts.append(ctx)
        plugins.append(plugin)
    for step in steps:
        for ctx, plugin in zip(contexts, plugins):
            ctx.step = step
            batch = {"input_ids": torch.arange(rows * 6).reshape(rows, 6) + 1000 * step + 100 * ctx.rank}
            plugin.inspect_batch(ctx=ctx, batch=batch, step=step, micro_step=0)
            plugin.on_before_optimizer_step(ctx=ctx, step=step)
        packed = [ctx.exchange.pack([0]) for ctx in contexts]  # the step guard's one all-gather
        for ctx in contexts:
            ctx.exchange.unpack(packed, 1)
        for ctx, plugin in zip(contexts, plugins):
            plugin.on_step_end(ctx=ctx, step=step)
    for ctx, plugin in zip(contexts, plugins):
        plugin.on_run_end(ctx=ctx)
    return contexts


def test_rows_beyond_the_exchanges_slot_make_data_skipped_unchecked_said_and_counted(tmp_path: Path) -> None:
    """2 ranks whose micro-batches hold 3 rows where the step exchange has room for 2 (packed or DPO rows): rank 0 never
    gets every rank's samples. It noted each step after the resume in a list for the rest of the run, and DATA_SKIPPED
    was not judged with only a log line to say so. Now it counts the steps up to the interrupted run's last, and says
    DATA_SKIPPED_UNCHECKED (info) with how many steps and why."""
    run_dir = tmp_path / "run" / "harness"
    _ranks_train(run_dir, range(1, 9), None)  # the interrupted run: steps 1-8
    contexts = _ranks_train(run_dir, range(5, 41), 4)  # resumed from step 4: 36 steps, of which 5-8 were trained before
    assert [r["code"] for r in contexts[1].reports] == []
    (unchecked,) = [r for r in contexts[0].reports if r["code"] != "RANK_DATA_OVERLAP"]
    assert unchecked["code"] == "DATA_SKIPPED_UNCHECKED" and unchecked["step"] == 40
    assert unchecked["evidence"]["unseen_steps"] == 4 and unchecked["evidence"]["interrupted_steps"] == 4
    assert unchecked["evidence"]["ranks_cut"] == [0, 1] and unchecked["evidence"]["slot_per_rank"] == 2
    assert "at 4 of the 4 steps the interrupted run trained after the checkpoint (steps 5-8)" in unchecked["message"]
    assert "more rows in a step than the exchange's slot of 2 per rank" in unchecked["message"], unchecked["message"]
    from harness.plugins.data_hash import DATA_SKIPPED_UNCHECKED

    assert DATA_SKIPPED_UNCHECKED.severity.value == "info"


def test_a_second_train_call_from_step_0_is_a_new_series_not_a_resume(make_trainer: Any, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Issue 44 item 14: ``trainer.train()`` twice on the same Trainer (the second call trains the trained weights from
    step 0 on the same data). Today: DATA_REPEATED at each of call 2's steps and call 1's rows marked superseded."""
    import logging

    caplog.set_level(logging.INFO, logger="harness")
    trainer = make_trainer(output_dir=tmp_path / "run", max_steps=4)
    harness.attach(trainer)
    trainer.train()
    trainer.train()
    assert trainer.state.global_step == 4
    assert findings_of(tmp_path / "run", "DATA_REPEATED") == []
    ledger = read_ledger(tmp_path / "run")
    assert sorted(ledger["attempt"].unique()) == [1, 2] and not ledger["superseded"].any()
    assert sum("counts it as a new series" in r.getMessage() for r in caplog.records) == 1

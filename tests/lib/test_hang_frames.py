"""Naming where a stuck thread waits, from its frames' paths and functions, and dumping every thread's stack."""
from __future__ import annotations

import threading
from pathlib import Path

from harness.lib.hang_frames import format_stacks, name_frames, short, thread_frames, write_stacks
from harness.lib.hang_summary import hang_summary, stall_order
from harness.core.findings import Finding, Severity

SITE = "/venv/lib/python3.11/site-packages"
TRAINER = [(f"{SITE}/transformers/trainer.py", 1881, "_run_epoch")]
GUARD = [(f"{SITE}/harness/hf/guard.py", 50, "_guard"), (f"{SITE}/harness/core/context.py", 190, "agree"),
         (f"{SITE}/harness/core/distributed.py", 110, "exchange_rows"), (f"{SITE}/torch/distributed/c10d_logger.py", 81, "wrapper"),
         (f"{SITE}/torch/distributed/distributed_c10d.py", 3900, "all_gather")]
DATA = [(f"{SITE}/transformers/trainer.py", 2300, "get_batch_samples"), (f"{SITE}/accelerate/data_loader.py", 590, "__iter__"),
        (f"{SITE}/torch/utils/data/dataloader.py", 733, "__next__"), (f"{SITE}/torch/utils/data/dataloader.py", 789, "_next_data"),
        (f"{SITE}/torch/utils/data/_utils/fetch.py", 52, "fetch"), ("/work/tests/my_data.py", 40, "__getitem__"),
        ("/usr/lib/python3.11/threading.py", 629, "wait")]
SAVE = [(f"{SITE}/transformers/trainer.py", 2285, "_maybe_log_save_evaluate"), (f"{SITE}/transformers/trainer.py", 3400, "_save_checkpoint"),
        (f"{SITE}/transformers/trainer.py", 3500, "_save_optimizer_and_scheduler"), (f"{SITE}/torch/serialization.py", 960, "save"),
        (f"{SITE}/torch/serialization.py", 1200, "_save")]
BACKWARD = [(f"{SITE}/transformers/trainer.py", 2000, "training_step"), (f"{SITE}/accelerate/accelerator.py", 2700, "backward"),
            (f"{SITE}/torch/_tensor.py", 620, "backward"), (f"{SITE}/torch/autograd/__init__.py", 350, "backward"),
            (f"{SITE}/torch/autograd/graph.py", 820, "_engine_run_backward")]


def test_a_collective_is_named_by_its_public_function_and_where_it_was_called() -> None:
    where = name_frames(TRAINER + GUARD, world_size=2)
    assert where.words == "in all_gather at the step guard" and where.kind == "collective"
    assert where.innermost[0] == "all_gather (.../torch/distributed/distributed_c10d.py:3900)" and len(where.innermost) == 6


def test_a_blocked_data_loader_names_the_dataset_frame() -> None:
    where = name_frames(TRAINER + DATA)
    assert where.kind == "data"
    assert where.words == "in the data loader's __next__ (in the dataset's __getitem__, /work/tests/my_data.py:40) fetching the step's batches"
    worker = name_frames(TRAINER + DATA[:3] + [(f"{SITE}/torch/utils/data/dataloader.py", 1300, "_get_data")])
    assert worker.words.startswith("in the data loader's __next__ (waiting for a worker process's batch)")


def test_a_save_names_torch_save_in_the_checkpoint() -> None:
    where = name_frames(TRAINER + SAVE)
    assert where.words == "in torch.save in the Trainer's checkpoint save" and where.kind == "save"


def test_backward_waits_for_other_ranks_only_with_several() -> None:
    assert name_frames(TRAINER + BACKWARD, world_size=2).kind == "collective"
    alone = name_frames(TRAINER + BACKWARD, world_size=1)
    assert alone.words == "in backward (the autograd engine) in the training step" and alone.kind == "compute"


def test_the_step_read_waits_for_the_other_ranks_only_with_several() -> None:
    """On a GPU a rank stuck outside DDP's all-reduce shows up on the others in the step guard's device read (it waits for
    the queued kernels, the NCCL all-reduce among them), not in a torch.distributed frame."""
    read = [(f"{SITE}/harness/hf/guard.py", 80, "read_step_values"), (f"{SITE}/harness/core/context.py", 120, "read_deferred"),
            (f"{SITE}/harness/core/deferred.py", 75, "read")]
    waiting = name_frames(TRAINER + read, world_size=2)
    assert waiting.kind == "collective" and waiting.words.startswith("in the step guard's device read")
    assert name_frames(TRAINER + read, world_size=1).kind != "collective"


def test_a_plain_wait_and_an_unknown_frame_are_named_by_the_innermost_frames() -> None:
    lock = name_frames(TRAINER + [("/work/app.py", 12, "worker_loop"), ("/usr/lib/python3.11/threading.py", 320, "wait")])
    assert lock.kind == "wait" and lock.words == "in threading's Event/Condition wait, called from worker_loop (/work/app.py:12)"
    other = name_frames([("/work/app.py", 7, "spin")])
    assert other.kind == "other" and other.words == "in spin (/work/app.py:7)"
    assert name_frames([]).kind == "other"


def test_a_shortened_path_is_marked_and_a_short_one_stays_whole() -> None:
    """The last three parts of an absolute path once read as a relative path (``tmp/trial_ranks/train2.py``)."""
    assert short(("/home/me/trial_ranks/train2.py", 73, "pre_hook")) == "pre_hook (.../me/trial_ranks/train2.py:73)"
    assert short(("/tmp/trial_ranks/train2.py", 73, "pre_hook")) == "pre_hook (/tmp/trial_ranks/train2.py:73)"
    assert short(("/train.py", 1, "main")) == "main (/train.py:1)"
    assert short(("pkg/sub/deep/mod.py", 5, "f")) == "f (.../sub/deep/mod.py:5)"
    assert short(("sub/mod.py", 5, "f")) == "f (sub/mod.py:5)"
    assert short(("C:\\work\\proj\\src\\train.py", 9, "g")) == "g (.../proj/src/train.py:9)"
    assert short(("<frozen runpy>", 88, "_run_code")) == "_run_code (<frozen runpy>:88)"


def test_a_live_thread_is_found_and_every_stack_is_dumped(tmp_path: Path) -> None:
    release, parked = threading.Event(), threading.Event()

    def park_here() -> None:
        parked.set()
        release.wait(5.0)

    thread = threading.Thread(target=park_here, name="parked")
    thread.start()
    try:
        assert parked.wait(5.0)
        frames = thread_frames(thread.ident)
        assert frames[-1][2] == "wait" and any(f[2] == "park_here" for f in frames)
        assert name_frames(frames).words.startswith("in threading's Event/Condition wait, called from wait")
        text = format_stacks(thread.ident)
        assert text.startswith("--- thread parked (ident") and "the training thread" in text.splitlines()[0] and "park_here" in text
        path = tmp_path / "stacks.txt"
        assert write_stacks(path, "HEADER", thread.ident) == "traceback"
        assert path.read_text().startswith("HEADER\n\n--- thread parked") and "MainThread" in path.read_text()
    finally:
        release.set()
        thread.join()


def _hang(rank: int, step: int, progress: list[int], since: float, where: str) -> Finding:
    return Finding("RANK_HANG", Severity.CRITICAL, "watchdog", f"rank {rank} hung", step=step, rank=rank,
                   evidence={"progress": progress, "stalled_since_unix": since, "where": where, "last_progress": "step 4 ended",
                             "stack_file": f"hangs/rank-{rank}-step-{step}.txt"})


def test_the_rank_that_made_the_least_progress_stalled_first() -> None:
    waiting = _hang(0, 5, [4, 1], 100.0, "in backward (the autograd engine, ...)")
    stuck = _hang(1, 5, [4, 0], 100.5, "in the data loader's __next__")
    assert [f.rank for f in stall_order([waiting, stuck])] == [1, 0]
    text = hang_summary([waiting, stuck])
    assert text is not None and text.startswith("rank 1 stalled first, at step 5: in the data loader's __next__ (its last progress: step 4 ended)")
    assert "then rank 0 in backward" in text and "hangs/rank-1-step-5.txt" in text
    assert hang_summary([]) is None
    gather = _hang(0, 5, [4, 0], 99.0, "in all_gather fetching the step's batches")
    gather.evidence["where_kind"] = "collective"
    assert stall_order([gather, stuck])[0].rank == 1  # same progress: rank 0 waits in a collective for rank 1, though it stopped earlier
    tie = _hang(0, 5, [4, 0], 99.0, "in a queue's get")
    assert stall_order([stuck, tie])[0].rank == 0  # same progress, neither in a collective: the earlier stall


def test_a_plugin_hook_is_the_place_named() -> None:
    frames = TRAINER + [("/work/main/harness/hf/guard.py", 50, "_guard"), ("/work/main/plugins/grad_sync.py", 300, "on_step_agreed"),
                        (f"{SITE}/torch/distributed/distributed_c10d.py", 3900, "all_gather")]
    assert name_frames(frames, world_size=2).words == "in all_gather in plugin grad_sync's on_step_agreed"
    tests = [("/work/main/tests/plugins/test_x.py", 10, "test_it")] + TRAINER + DATA
    assert "plugin" not in name_frames(tests).words

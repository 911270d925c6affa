"""Memory that stays flat over a long run: hash multipliers, data_hash's seen-sets, and one ledger read per resume."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import harness
import harness.lib.ledger
from conftest import findings_of
from harness.lib import hashing
from harness.plugins.data_hash import DataHash, DataHashOptions


def _fresh_weights(length: int) -> torch.Tensor:
    """The multipliers exactly as the original per-length cache drew them."""
    generator = torch.Generator().manual_seed(0x7A3D_5EED)
    return torch.randint(0, 2**62, (max(length, 1),), generator=generator, dtype=torch.int64) * 2 + 1


def test_hash_weights_cache_is_bounded() -> None:
    """Any lengths in any order: one cached tensor per device, and every hash bit-identical to a fresh computation."""
    hashing._weights.clear()
    lengths = [37, 5, 4096, 1, 300, 64, 65, 2000, 17, 4097, 3, 9000, 128, 1]
    rng = random.Random(0)
    for length in lengths:
        ids = torch.randint(0, 50_000, (3, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[1, length // 2:] = 0  # right padding on one row
        expected = ((ids + 1) * mask * _fresh_weights(length)[:length]).sum(dim=1)
        assert torch.equal(hashing.device_row_hashes(ids, mask), expected)
        rows = [rng.getrandbits(63) for _ in range(rng.randint(1, 40))]
        weights = _fresh_weights(len(rows) + 1)[1:].tolist()
        total = sum(h * w for h, w in zip(rows, weights)) & 0xFFFF_FFFF_FFFF_FFFF
        assert hashing.combine_row_hashes(rows) == (total - (1 << 64) if total >= 1 << 63 else total)
        assert len(hashing._weights) == 1  # one tensor for the CPU, whatever the lengths seen so far
    (cached,) = hashing._weights.values()
    assert max(lengths) <= cached.shape[0] <= 2 * max(lengths)


class _Ctx(SimpleNamespace):
    """What data_hash's sample check uses of the run context: the rank, and a findings sink."""

    def report(self, code: str, message: str, **kwargs: Any) -> None:
        self.found.append((code, kwargs.get("step"), kwargs.get("evidence")))


def test_data_hash_memory_is_bounded(make_trainer: Any, lm_rows: Any) -> None:
    from datasets import concatenate_datasets

    plugin = DataHash()
    ctx = _Ctx(rank=0, found=[], run_dir=Path("."))
    plugin.configure(ctx=ctx, options=DataHashOptions(seen_capacity=1000))
    rng = random.Random(1)
    first = [rng.getrandbits(64) - (1 << 63) for _ in range(64)]
    plugin._check_samples(ctx, 1, first, None)
    sizes = set()
    for step in range(2, 1500):  # ~96k distinct samples, 96x the capacity
        plugin._check_samples(ctx, step, [rng.getrandbits(64) - (1 << 63) for _ in range(64)], None)
        sizes.add((len(plugin._seen), plugin._seen.nbytes))
    assert ctx.found == []  # no false repeat, in the table or out of it
    assert len(plugin._seen) == 1000 and max(n for n, _ in sizes) == 1000
    assert max(b for _, b in sizes) <= 64 * 1000 and plugin._seen.untracked > 90_000
    plugin._check_samples(ctx, 1500, [first[5], rng.getrandbits(63)], None)  # a planted repeat of a remembered sample
    assert [(c, s, e["rows"]) for c, s, e in ctx.found] == [("DATA_REPEATED", 1500, [0])]

    ids_ctx = _Ctx(rank=0, found=[], run_dir=Path("."))  # with sample ids: the content table is bounded too
    plugin = DataHash()
    plugin.configure(ctx=ids_ctx, options=DataHashOptions(seen_capacity=500, max_duplicates=10**9))
    for step in range(200):
        plugin._check_samples(ids_ctx, step, [rng.getrandbits(63) for _ in range(32)], [f"src:{step}:{i}" for i in range(32)])
    assert len(plugin._seen) == len(plugin._content_ids) == 500 and ids_ctx.found == []
    plugin._check_samples(ids_ctx, 200, [0], ["src:0:3"])
    assert [c for c, _, _ in ids_ctx.found] == ["DATA_REPEATED"]

    # a real run over one epoch in which every content appears twice, remembering only 4 samples
    twice = concatenate_datasets([lm_rows.select(range(16)), lm_rows.select(range(16))])
    trainer = make_trainer(max_steps=8, train_dataset=twice)
    run = harness.attach(trainer, config={"plugins": ["data_hash"], "data_hash": {"seen_capacity": 4, "index_max_rows": 0}})
    trainer.train()
    table = run.manager.plugin("data_hash")._seen
    assert len(table) == 4 and table.untracked == 32 - 2 * 4  # the 12 contents it had no room for, both copies each
    repeated = findings_of(trainer.args.output_dir, "DATA_REPEATED")
    assert repeated and sum(len(f["evidence"]["rows"]) for f in repeated) == 4  # each remembered sample's second copy


def test_resume_reads_the_ledger_once(make_trainer: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """data_hash numbers its attempt, finds the repeats, resume_check the wrong position: one read of the ledger in all."""
    out = tmp_path / "run"
    first = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5)
    harness.attach(first)
    first.train()
    shutil.rmtree(out / "checkpoint-14", ignore_errors=True)
    ledger_file = (out / "harness" / "ledger" / "rank-0.jsonl").resolve()
    reads: list[str] = []
    real_open = open

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if Path(file).resolve() == ledger_file and not any(c in mode for c in "aw+"):
            reads.append(mode)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(harness.lib.ledger, "open", counting_open, raising=False)  # the ledger module's own reads, counted
    resumed = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5, ignore_data_skip=True)
    harness.attach(resumed)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    assert findings_of(out, "RESUME_DATA_POSITION")[0]["step"] == 11  # resume_check read the interrupted run's batches
    assert findings_of(out, "DATA_REPEATED")[0]["step"] == 11  # data_hash read what the epoch had trained
    assert len(reads) == 1


def _generic_row_hashes(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The definition, written out: sum over positions of (id + 1) * mask * weight, wrapping modulo 2^64."""
    from harness.lib.hashing import _position_weights

    values = ids.to(torch.int64) + 1
    if mask is not None:
        values = values * mask.to(torch.int64)
    return (values * _position_weights(ids.device, ids.shape[1])).sum(dim=1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_row_hashes_are_the_defined_sums(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 2**31 - 1, (5, 37), generator=generator).to(dtype)
    mask = torch.ones(5, 37, dtype=torch.int64)
    mask[2, 20:] = 0
    mask[4, :] = 0
    from harness.lib.hashing import device_row_hashes, hash_token_rows, host_row_hashes

    assert torch.equal(device_row_hashes(ids, mask), _generic_row_hashes(ids, mask))
    assert torch.equal(device_row_hashes(ids, mask.bool()), _generic_row_hashes(ids, mask))
    assert torch.equal(device_row_hashes(ids, mask.float()), _generic_row_hashes(ids, mask))  # a float mask: still exact int64
    assert torch.equal(device_row_hashes(ids), _generic_row_hashes(ids, None))
    assert device_row_hashes(ids).tolist() == hash_token_rows(ids.tolist())  # the host hash of dataset rows agrees
    for m in (mask, mask.bool(), mask.float(), None):  # numpy's sums (dataset indexing) wrap around as torch's do
        assert host_row_hashes(ids, m) == device_row_hashes(ids, m).tolist()

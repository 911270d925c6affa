"""DeferredReads (harness.core.deferred): every queued tensor read in one transfer, values exact and in order."""
from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from harness.core.deferred import DeferredReads

HOST_READS = {"cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "to"}


class CountReads(TorchFunctionMode):
    """Counts the tensor methods that could copy to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[True, False], ids=["joined", "one-by-one"])
def join_host(request: pytest.FixtureRequest) -> bool:
    """Every test runs both read paths: joined and copied once (what device tensors take; here on the host) and one
    ``tolist`` per host tensor (what a CPU run takes)."""
    return bool(request.param)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_everything_queued_is_read_in_one_transfer(join_host: bool) -> None:
    reads = DeferredReads(join_host=join_host)
    for i in range(5):
        reads.defer("p", f"k{i}", torch.tensor(float(i)))
    reads.defer("q", "mask", torch.tensor([True, False]))
    assert reads.pending == 6
    with CountReads() as mode:
        reads.read()
    if join_host:  # joined and read with one numpy() (device tensors: one cpu()), no per-tensor read
        assert mode.calls.count("cpu") + mode.calls.count("numpy") == 1 and not {"item", "tolist", "__bool__", "__float__"} & set(mode.calls)
    else:  # a CPU run's tensors: one tolist each, no tensor operation to join them
        assert mode.calls == ["tolist"] * 6
    assert reads.reads == 1 and reads.pending == 0
    assert [reads.values("p", f"k{i}") for i in range(5)] == [[0.0], [1.0], [2.0], [3.0], [4.0]]
    assert reads.values("q", "mask") == [[True, False]]


def test_joining_host_tensors_set_after_construction_takes_the_joined_path() -> None:
    """The sync benchmark sets ``join_host`` on an attached run's reads: the host loop must not read them one by one."""
    reads = DeferredReads()
    reads.join_host = True
    for i in range(3):
        reads.defer("p", f"k{i}", torch.tensor(float(i)))
    with CountReads() as mode:
        reads.read()
    assert mode.calls.count("cpu") + mode.calls.count("numpy") == 1 and "tolist" not in mode.calls
    assert [reads.values("p", f"k{i}") for i in range(3)] == [[0.0], [1.0], [2.0]]
    reads.join_host = False  # and back: one tolist each
    reads.defer("p", "k", torch.tensor(5.0))
    with CountReads() as mode:
        reads.read()
    assert mode.calls == ["tolist"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_floats_come_back_bit_exact_with_nan_and_inf(dtype: torch.dtype, join_host: bool) -> None:
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal of this dtype
    source = torch.tensor([0.1, -0.0, math.inf, -math.inf, math.nan, torch.finfo(dtype).max, tiny], dtype=dtype)
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "x", source)
    reads.read()
    (values,) = reads.values("p", "x")
    expected = source.to(torch.float64).tolist()
    assert [_bits(v) for v in values] == [_bits(e) for e in expected]
    assert all(type(v) is float for v in values)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_integers_come_back_exact_at_the_extremes(dtype: torch.dtype, join_host: bool) -> None:
    info = torch.iinfo(dtype)
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "x", torch.tensor([info.min, -1 if info.min < 0 else 0, 0, info.max], dtype=dtype))
    reads.defer("p", "scalar", torch.tensor(info.max, dtype=dtype))
    reads.read()
    assert reads.values("p", "x") == [[info.min, -1 if info.min < 0 else 0, 0, info.max]]
    assert reads.values("p", "scalar") == [info.max] and type(reads.values("p", "scalar")[0]) is int


def test_bools_and_shapes(join_host: bool) -> None:
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "flag", torch.tensor(True))
    reads.defer("p", "grid", torch.arange(6).reshape(2, 3))
    reads.defer("p", "one", torch.tensor([7.5]))
    reads.defer("p", "empty", torch.zeros(0))
    reads.defer("p", "empty2d", torch.zeros(2, 0, dtype=torch.bool))
    reads.defer("p", "host", 3)  # a plain number is accepted too
    reads.read()
    assert reads.values("p", "flag") == [True] and type(reads.values("p", "flag")[0]) is bool
    assert reads.values("p", "grid") == [[[0, 1, 2], [3, 4, 5]]]
    assert reads.values("p", "one") == [[7.5]]
    assert reads.values("p", "empty") == [[]] and reads.values("p", "empty2d") == [[[], []]]
    assert reads.values("p", "host") == [3]


def test_repeated_keys_keep_their_order_and_owners_are_apart(join_host: bool) -> None:
    reads = DeferredReads(join_host=join_host)
    for micro_batch, loss in enumerate([2.5, 1.5, 3.5]):
        reads.defer("nan_guard", "finite", torch.tensor(micro_batch != 1))
        reads.defer("spike", "loss", torch.tensor(loss))
    reads.defer("other", "loss", torch.tensor(9.0))
    reads.read()
    assert reads.values("nan_guard", "finite") == [True, False, True]
    assert reads.values("spike", "loss") == [2.5, 1.5, 3.5]
    assert reads.values("other", "loss") == [9.0] and reads.values("nobody", "loss") == []


def test_the_next_read_replaces_the_values_and_an_empty_read_transfers_nothing(join_host: bool) -> None:
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "a", torch.tensor(1.0))
    reads.read()
    reads.defer("p", "b", torch.tensor(2.0))
    reads.read()
    assert reads.values("p", "a") == [] and reads.values("p", "b") == [2.0]
    with CountReads() as mode:
        reads.read()
    assert mode.calls == [] and reads.reads == 2 and reads.values("p", "b") == []


def test_a_tensor_that_needs_grad_is_read_detached_and_later_changes_do_not_leak_in(join_host: bool) -> None:
    weight = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = (weight * 2).sum()
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "loss", loss)
    reads.read()
    assert reads.values("p", "loss") == [6.0]
    reads.clear()
    assert reads.values("p", "loss") == [] and reads.pending == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_of_several_dtypes_in_one_transfer() -> None:
    reads = DeferredReads()
    reads.defer("p", "loss", torch.tensor(float("nan"), device="cuda"))
    reads.defer("p", "ids", torch.tensor([2**62, -(2**63)], device="cuda"))
    reads.defer("p", "ok", torch.tensor(False, device="cuda"))
    reads.read()
    assert math.isnan(reads.values("p", "loss")[0])
    assert reads.values("p", "ids") == [[2**62, -(2**63)]] and reads.values("p", "ok") == [False]


def test_a_tensor_that_cannot_be_read_costs_only_its_own_plugin(join_host: bool) -> None:
    reads, failed = DeferredReads(join_host=join_host), []
    reads.defer("good", "x", torch.tensor(2.5))
    reads.defer("bad", "z", torch.tensor(1 + 2j))
    reads.defer("bad", "m", torch.empty(3, device="meta"))
    reads.read(on_error=lambda owner, exc: failed.append(owner))
    assert reads.values("good", "x") == [2.5]
    assert reads.values("bad", "z") == [] and reads.values("bad", "m") == [] and failed == ["bad", "bad"]


def test_python_floats_stay_exact_and_a_dead_step_s_queue_is_dropped(join_host: bool) -> None:
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "x", 0.1)
    reads.read()
    assert reads.values("p", "x") == [0.1]
    reads.defer("p", "x", torch.tensor(7.0))
    reads.drop_pending()
    reads.read()
    assert reads.values("p", "x") == [] and reads.pending == 0


def test_host_values_come_back_as_they_are_in_order_with_tensors_and_cost_no_read(join_host: bool) -> None:
    """A value computed on the host (from CPU data) is queued without a tensor op and returned unchanged, in its place."""
    reads = DeferredReads(join_host=join_host)
    reads.defer("p", "k", [1, 2, -3])
    reads.defer("p", "k", torch.tensor([4, 5]))
    reads.defer("p", "k", True)
    reads.defer("p", "x", 0.1)
    reads.read()
    assert reads.values("p", "k") == [[1, 2, -3], [4, 5], True] and reads.values("p", "x") == [0.1]
    assert reads.reads == 1
    reads.defer("p", "k", [7])
    reads.read()
    assert reads.values("p", "k") == [[7]] and reads.reads == 1  # host values alone: no transfer


def test_scalars_and_arrays_of_mixed_dtypes_interleaved_come_back_in_their_places(join_host: bool) -> None:
    """The read stacks a kind's scalars first and appends its arrays after: each value must still land on its own key."""
    reads = DeferredReads(join_host=join_host)
    queued: list[tuple[str, Any, Any]] = [
        ("a", torch.tensor(0.1, dtype=torch.float16), torch.tensor(0.1, dtype=torch.float16).item()),
        ("b", torch.tensor([1.5, -2.25], dtype=torch.float32), [1.5, -2.25]),
        ("c", torch.tensor(True), True),
        ("d", torch.tensor(3.0, dtype=torch.bfloat16), 3.0),
        ("e", torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, 1], [1, 5, 9]),  # a strided 1-d view
        ("f", torch.tensor([[True, False], [False, True]]), [[True, False], [False, True]]),
        ("g", torch.tensor(2**62), 2**62),
        ("h", torch.nn.Parameter(torch.tensor([0.5, 0.25], dtype=torch.float64)), [0.5, 0.25]),
        ("i", torch.tensor(-7, dtype=torch.int8), -7),
    ]
    for key, tensor, _ in queued:
        reads.defer("p", key, tensor)
    with CountReads() as mode:
        reads.read()
    assert mode.calls.count("numpy") + mode.calls.count("cpu") == (1 if join_host else 0)
    for key, _, expected in queued:
        (value,) = reads.values("p", key)
        assert value == expected and type(value) is type(expected), key
        if isinstance(value, list) and value and isinstance(value[0], list):
            assert all(type(v) is bool for row in value for v in row)


def test_a_cpu_run_keeps_its_host_loop_after_a_tensor_it_cannot_read() -> None:
    """The one-by-one host loop hands an odd tensor to the general path (which charges it) and stays on for the next
    read: only a device tensor, a device run, turns it off."""
    reads, failed = DeferredReads(), []
    reads.defer("good", "x", torch.tensor([1, 2]))
    reads.defer("bad", "z", torch.tensor(1 + 2j))
    reads.read(on_error=lambda owner, exc: failed.append(owner))
    assert reads.values("good", "x") == [[1, 2]] and failed == ["bad"] and reads._host_run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_run_reads_host_and_device_tensors_once_and_skips_the_host_loop_from_then_on() -> None:
    reads = DeferredReads()
    for _ in range(2):
        reads.defer("p", "host", torch.tensor([3, 4]))
        reads.defer("p", "dev", torch.tensor(2.5, device="cuda"))
        reads.read()
        assert reads.values("p", "host") == [[3, 4]] and reads.values("p", "dev") == [2.5]
        assert not reads._host_run

"""Fresh or trained weights, read from the normalisation layers (what a model's first loss should be judged against)."""
from __future__ import annotations

from typing import Any

import torch

from harness.lib.model_state import loaded_from, weights_state


def test_a_fresh_model_is_fresh_and_one_trained_step_makes_it_trained(tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    model = build_tiny_llama(tokenizer, seed=0)
    assert weights_state(model) == "fresh" and loaded_from(model) is None
    ids = torch.randint(0, len(tokenizer), (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.Adam(model.parameters(), lr=1e-3).step()
    assert weights_state(model) == "trained"


def test_zero_initialised_norms_are_fresh_and_a_model_without_norms_is_unknown() -> None:
    class GemmaStyleNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))  # (1 + w) norms start at w = 0

    assert weights_state(torch.nn.Sequential(GemmaStyleNorm(), torch.nn.Linear(8, 8))) == "fresh"
    assert weights_state(torch.nn.Linear(8, 8)) == "unknown"


def test_a_model_loaded_from_a_directory_names_it(tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    from harness.lib.tiny import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "m", vocab_size=256)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert loaded_from(model) == str(path) and weights_state(model) == "fresh"  # saved untrained: still judged against ln(V)

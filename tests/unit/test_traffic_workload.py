"""Workload generation, with a fake tokenizer and a tiny real one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.traffic.workload import (
    LengthDist,
    Tokenizer,
    WorkloadConfig,
    build_workload,
    load_tokenizer,
    token_pool,
)

WORDS = ("hello", "world", "how", "are", "you", "today", "the", "a", "is", "fine")


class FakeTokenizer:
    """Whitespace words -> ids by a fixed table; ids 0-2 are special."""

    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return 100

    def encode(self, text: str) -> list[int]:
        return [3 + (sum(map(ord, w)) % 97) for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in token_ids)


def make_tiny_tokenizer(folder: Path) -> Path:
    """A real Hugging Face tokenizer folder (word level) that AutoTokenizer can load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", *(f"w{i}" for i in range(60)),
             *WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]", "<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
        "bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_fixed_and_uniform_lengths() -> None:
    rng = np.random.default_rng(0)
    assert set(LengthDist(50).sample(rng, 100)) == {50}
    u = LengthDist(100, "uniform", 0.2).sample(rng, 5000)
    assert u.min() >= 80 and u.max() <= 120
    assert u.mean() == pytest.approx(100, rel=0.02)


def test_normal_and_lognormal_keep_the_mean_and_stay_positive() -> None:
    rng = np.random.default_rng(1)
    n = LengthDist(200, "normal", 0.25).sample(rng, 20_000)
    assert n.mean() == pytest.approx(200, rel=0.02)
    assert n.std() == pytest.approx(50, rel=0.05)
    ln = LengthDist(200, "lognormal", 0.8, max_len=10_000).sample(rng, 20_000)
    assert ln.mean() == pytest.approx(200, rel=0.05)
    assert ln.min() >= 1
    wide = LengthDist(3, "normal", 2.0).sample(rng, 1000)
    assert wide.min() >= 1  # clipped, never zero or negative


def test_bad_lengths_are_refused() -> None:
    for args in ((0,), (10, "zipf"), (10, "uniform", 1.5), (10, "normal", -1.0)):
        with pytest.raises(ValueError):
            LengthDist(*args)  # type: ignore[arg-type]


def test_token_pool_leaves_out_special_tokens() -> None:
    pool = token_pool(FakeTokenizer(), None)
    assert len(pool) == 97 and 0 not in pool and 99 in pool
    assert len(token_pool(None, 10)) == 10
    with pytest.raises(ValueError):
        token_pool(None, None)


def test_random_workload_has_exact_lengths_and_is_seeded() -> None:
    cfg = WorkloadConfig(num_requests=20, seed=5, input_len=LengthDist(64, "uniform", 0.5),
                         output_len=LengthDist(16))
    specs = build_workload(cfg, FakeTokenizer())
    assert len(specs) == 20
    assert all(32 <= len(s.prompt_ids) <= 96 and s.output_len == 16 for s in specs)
    assert all(3 <= i < 100 for s in specs for i in s.prompt_ids)
    again = build_workload(cfg, FakeTokenizer())
    assert [s.prompt_ids for s in specs] == [s.prompt_ids for s in again]
    other = build_workload(WorkloadConfig(num_requests=20, seed=6, vocab_size=100), None)
    assert [s.prompt_ids for s in specs] != [s.prompt_ids for s in other]


def test_shared_prefix_groups_share_their_prefix() -> None:
    cfg = WorkloadConfig(dataset="shared-prefix", num_requests=40, num_prefixes=3,
                         prefix_len=32, input_len=LengthDist(8), vocab_size=1000)
    specs = build_workload(cfg, None)
    prefixes = {tuple(s.prompt_ids[:32]) for s in specs}
    assert len(prefixes) <= 3 and len(prefixes) >= 2
    assert all(len(s.prompt_ids) == 40 for s in specs)
    assert len({tuple(s.prompt_ids[32:]) for s in specs}) > 1  # suffixes differ


def test_mixed_workload_has_the_exact_share_of_long_prompts() -> None:
    cfg = WorkloadConfig(dataset="mixed", num_requests=50, long_share=0.2, vocab_size=500,
                         input_len=LengthDist(100), output_len=LengthDist(128),
                         long_input_len=LengthDist(1800), long_output_len=LengthDist(16))
    specs = build_workload(cfg, None)
    long = [s for s in specs if s.kind == "long"]
    chat = [s for s in specs if s.kind == "chat"]
    assert len(long) == 10 and len(chat) == 40
    assert all(len(s.prompt_ids) == 1800 and s.output_len == 16 for s in long)
    assert all(len(s.prompt_ids) == 100 and s.output_len == 128 for s in chat)


def test_text_prompts_are_decoded_when_asked() -> None:
    cfg = WorkloadConfig(num_requests=2, input_len=LengthDist(3), with_text=True)
    specs = build_workload(cfg, FakeTokenizer())
    assert all(s.prompt_text == FakeTokenizer().decode(s.prompt_ids) for s in specs)
    with pytest.raises(ValueError):
        build_workload(WorkloadConfig(num_requests=2, with_text=True, vocab_size=9), None)


def test_file_datasets_need_a_path_and_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(dataset="sharegpt")
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    with pytest.raises(ValueError):
        build_workload(WorkloadConfig(dataset="prompts", path=str(path)), None)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_sharegpt_lengths_come_from_the_model_tokenizer(tmp_path: Path,
                                                        tiny_tokenizer: Tokenizer) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "hello world how are you"},
                           {"from": "gpt", "value": "fine fine fine fine fine today"}]},
        {"conversations": [{"from": "human", "value": "hi"},  # too short: skipped
                           {"from": "gpt", "value": "the a is fine"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},  # skipped
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    cfg = WorkloadConfig(dataset="sharegpt", path=str(path), num_requests=3)
    specs = build_workload(cfg, tiny_tokenizer)
    assert len(specs) == 3  # the one usable conversation, reused
    assert all(len(s.prompt_ids) == 5 and s.output_len == 6 for s in specs)
    assert specs[0].prompt_text == "hello world how are you"
    cfg = WorkloadConfig(dataset="sharegpt", path=str(path), num_requests=1,
                         sharegpt_output_from_file=False, output_len=LengthDist(9))
    fixed = build_workload(cfg, tiny_tokenizer)
    assert fixed[0].output_len == 9


def test_prompt_files_plain_and_jsonl(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    txt = tmp_path / "prompts.txt"
    txt.write_text("hello world\n\nhow are you today\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "the a is fine"}) + "\n")
    specs = build_workload(WorkloadConfig(dataset="prompts", path=str(txt), num_requests=4,
                                          output_len=LengthDist(8)), tiny_tokenizer)
    assert sorted({len(s.prompt_ids) for s in specs}) == [2, 4]
    assert all(s.output_len == 8 and s.prompt_text for s in specs)
    one = build_workload(WorkloadConfig(dataset="prompts", path=str(jsonl), num_requests=1),
                         tiny_tokenizer)
    assert len(one[0].prompt_ids) == 4

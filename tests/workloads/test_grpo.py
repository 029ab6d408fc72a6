"""The CPU GRPO workload: a tiny LM learns the digit task; ``conduit train --algo grpo``."""

import json

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames

from conduit.report import pyplot  # noqa: E402
from conduit.workloads import grpo_task  # noqa: E402
from conduit.workloads.cli import train_main  # noqa: E402


def test_digit_vocabulary_round_trips():
    tok = grpo_task.digit_tokenizer()
    ids = tok("3 1 4 =")["input_ids"]
    assert ids == [8, 6, 9, 4]
    assert grpo_task.completion_digits(tok.decode([12, 12, 2], skip_special_tokens=True)) == \
        ["7", "7"]
    rewards = grpo_task.reward_fn("copy")(prompts=["3 1 =", "5 5 ="],
                                          completions=["3 3 1", ""])
    assert rewards == [2 / 3, 0.0]
    with pytest.raises(ValueError, match="task"):
        grpo_task.reward_fn("sort")


def test_mean_reward_rises_through_conduit(tmp_path):
    out = tmp_path / "grpo.json"
    rc = train_main(["--algo", "grpo", "--steps", "20", "--seed", "0", "--out", str(out)])
    assert rc == 0
    log = json.loads(out.read_text())
    rewards = log["rewards"]
    assert len(rewards) == 5  # 20 steps, 4 mini-batches per generation batch
    assert len(log["losses"]) == 20
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, rewards
    if pyplot() is not None:
        assert (tmp_path / "grpo.png").stat().st_size > 0

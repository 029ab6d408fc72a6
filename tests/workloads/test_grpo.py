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
    assert len(log["losses"]) == 20 and log["diverged"] is None
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, rewards
    if pyplot() is not None:
        assert (tmp_path / "grpo.png").stat().st_size > 0


@pytest.mark.parametrize("buffer", ["conduit", "trl"])
def test_a_diverged_policy_stops_the_run_with_its_steps_written(tmp_path, capsys, buffer):
    # lr 1e30: the first update leaves finite but huge weights, whose logits overflow when
    # the next generation batch samples completions (after step 4)
    out = tmp_path / "grpo.json"
    rc = train_main(["--algo", "grpo", "--buffer", buffer, "--steps", "12", "--lr", "1e30",
                     "--log-every", "0", "--out", str(out)])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "stopped after step 4 of 12: the policy's next-token probabilities" in printed
    assert "(the run diverged; lower --lr)" in printed
    log = json.loads(out.read_text())
    assert len(log["losses"]) == 4 and len(log["rewards"]) == 1
    assert "not a distribution" in log["diverged"]
    if pyplot() is not None:
        assert (tmp_path / "grpo.png").stat().st_size > 0


def test_an_error_that_is_not_a_divergence_still_raises(tmp_path):
    from conduit.workloads import grpo

    def break_generation(trainer):
        def fail(*_a, **_k):
            raise RuntimeError("some other failure")
        trainer.train = fail
    with pytest.raises(RuntimeError, match="some other failure"):
        grpo.train(grpo.Args(steps=1, log_every=0, out=str(tmp_path / "g.json")),
                   hook=break_generation)


def test_a_loss_that_is_not_finite_is_named_and_fails_the_run(tmp_path, capsys):
    from conduit.workloads import grpo
    args = grpo.Args(steps=3, out=str(tmp_path / "g.json"))
    result = grpo.GRPOResult(args, losses=[0.5, float("nan"), 0.1], rewards=[0.1], wall_s=1.0)
    assert grpo.report(result, args) == 1
    assert "the loss was not finite at step 2 (the run diverged; lower --lr)" in \
        capsys.readouterr().out
    log = json.loads((tmp_path / "g.json").read_text())
    assert log["losses"] == [0.5, None, 0.1]
    assert log["diverged"] == "the loss was not finite at step 2"
    fine = grpo.GRPOResult(args, losses=[0.5, 0.2, 0.1], rewards=[0.1], wall_s=1.0)
    assert grpo.report(fine, args) == 0
    assert "not finite" not in capsys.readouterr().out
    assert json.loads((tmp_path / "g.json").read_text())["diverged"] is None

"""ConduitGRPOTrainer against TRL's own GRPOTrainer: same advantages, same mini-batches, same
losses and updates for a seed."""

import dataclasses
import tempfile

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames

from conduit.errors import ConfigError  # noqa: E402
from conduit.integrations.grpo import combine_rewards, group_advantages  # noqa: E402
from conduit.workloads import grpo_task  # noqa: E402
from conduit.workloads.grpo import Args, build_trainer, train  # noqa: E402

SMALL = Args(steps=4, batch_size=8, num_generations=4, steps_per_generation=2,
             max_completion_length=8, seed=3)


def _unscorable_or_constant(prompts, completions, **_):
    """None for completions without digits; the same reward for a whole group when its prompt
    starts with 0 or 1 (zero standard deviation); else the share of 7s."""
    out = []
    for p, c in zip(prompts, completions):
        d = grpo_task.completion_digits(c)
        if p.split()[0] in ("0", "1"):
            out.append(0.5)
        elif not d:
            out.append(None)
        else:
            out.append(sum(t == "7" for t in d) / len(d))
    return out


def _length(prompts, completions, **_):
    return [0.0 if p.split()[0] in ("0", "1") else float(len(c.split()))
            for p, c in zip(prompts, completions)]


def _generation_batch(trainer, n_prompts, seed):
    prompts = grpo_task.prompt_dataset(n=n_prompts, prompt_len=4, seed=seed)["prompt"]
    g = trainer.num_generations
    return [{"prompt": p} for p in prompts for _ in range(g)]


@pytest.mark.parametrize("scale", ["group", "none"])
def test_advantages_equal_trls_own_on_the_same_groups(scale):
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(dataclasses.replace(SMALL, batch_size=16, num_generations=8,
                                                    steps_per_generation=8),
                                output_dir=tmp)
    trainer.args.reward_weights = None
    trainer.reward_funcs = [_unscorable_or_constant, _length]
    trainer.reward_func_names = ["mixed", "length"]
    trainer.reward_processing_classes = [None, None]
    trainer.reward_weights = torch.tensor([1.0, 0.25])
    trainer.scale_rewards = scale
    trainer.model.train()
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(_generation_batch(trainer, 16, seed=5))
    per_func = torch.tensor([[float("nan") if v is None else v
                              for v in trainer._logs["rewards"][name]]
                             for name in ("mixed", "length")]).T
    assert torch.isnan(per_func[:, 0]).any()  # the batch exercises unscorable completions
    rewards = combine_rewards(per_func, trainer.reward_weights)
    ours = group_advantages(rewards, trainer.num_generations, scale=scale)
    assert torch.equal(ours, out["advantages"])
    assert (ours.view(-1, 8) == 0).all(dim=1).any()  # and a zero-std group


@pytest.mark.parametrize("group_size", [2, 3, 8, 16, 64])
def test_advantages_of_full_groups_are_bit_equal_to_trls_formula(group_size):
    from trl.trainer.utils import nanstd as trl_nanstd

    gen = torch.Generator().manual_seed(group_size)
    for trial in range(50):
        scale = 10.0 ** torch.randint(-3, 4, (1,), generator=gen).item()
        rewards = torch.randn(group_size * 7, generator=gen) * scale
        if trial % 3 == 0:
            rewards = torch.rand(group_size * 7, generator=gen).round()  # ties, zero-std groups
        grouped = rewards.view(-1, group_size)  # TRL's steps for scale_rewards="group"
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size, dim=0)
        std = trl_nanstd(grouped, dim=1).repeat_interleave(group_size, dim=0)
        want = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
        assert torch.equal(group_advantages(rewards, group_size), want)


def _both(args, **conduit_kwargs):
    with tempfile.TemporaryDirectory() as tmp:
        ref = build_trainer(dataclasses.replace(args, buffer="trl"), output_dir=tmp)
        got = build_trainer(dataclasses.replace(args, buffer="conduit"), output_dir=tmp,
                            **conduit_kwargs)
    return ref, got


#: Groups of 3 over mini-batches of 2: a group straddles a mini-batch boundary.
STRADDLE = dataclasses.replace(SMALL, batch_size=2, num_generations=3, steps_per_generation=3)


@pytest.mark.parametrize(("args", "pad"), [(SMALL, "minibatch"), (SMALL, "iteration"),
                                           (STRADDLE, "minibatch")],
                         ids=["minibatch", "iteration", "straddling-groups"])
def test_minibatches_equal_trls_for_a_seed(args, pad):
    ref, got = _both(args, pad_completions_to=pad)
    s = args.steps_per_generation
    for t in (ref, got):
        t.model.train()
    batch = _generation_batch(ref, args.batch_size * s // args.num_generations, seed=9)
    torch.manual_seed(11)
    want = []
    for step in range(s):
        ref._step = step
        want.append(ref._prepare_inputs(batch))
    torch.manual_seed(11)
    have = [got._prepare_inputs(batch) for _ in range(s)]
    got._conduit.close()
    for k, (w, h) in enumerate(zip(want, have)):
        width = h["completion_ids"].shape[1]
        longest = int(w["completion_mask"].sum(dim=1).max())
        assert width == (longest if pad == "minibatch" else w["completion_ids"].shape[1])
        assert not w["completion_mask"][:, width:].any()  # TRL's extra columns are padding
        for key in ("prompt_ids", "prompt_mask", "advantages", "num_items_in_batch"):
            assert torch.equal(w[key], h[key]), key
        for key in ("completion_ids", "completion_mask"):
            assert torch.equal(w[key][:, :width], h[key]), key
        # The first mini-batch is trained under the generating policy: the learner's own
        # log-probs serve as old ones. The others come from the snapshot, computed in delivery.
        assert ("old_per_token_logps" in h) == (k > 0)
        if k > 0:
            mask = h["completion_mask"].bool()
            assert torch.equal(w["old_per_token_logps"][:, :width][mask],
                               h["old_per_token_logps"][mask])


@pytest.mark.parametrize("kw", [
    dict(num_iterations=1, max_completion_length=12),
    dict(num_iterations=2, beta=0.05),
])
def test_losses_and_updates_identical_to_trl(kw):
    args = dataclasses.replace(SMALL, steps=8, **kw)
    ref = train(dataclasses.replace(args, buffer="trl"))
    got = train(dataclasses.replace(args, buffer="conduit"))
    assert len(ref.losses) == args.steps
    assert ref.losses == got.losses  # exactly, not to a tolerance
    assert ref.rewards == got.rewards
    assert ref.params.keys() == got.params.keys()
    for k in ref.params:
        assert torch.equal(ref.params[k], got.params[k]), k
    assert got.trainer._conduit is None  # the plane closed with train()


def test_settings_the_path_does_not_carry_are_refused():
    from trl import GRPOConfig

    from conduit.integrations.trl import ConduitGRPOTrainer

    tok = grpo_task.digit_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=8, num_generations=4,
                         use_cpu=True, report_to="none", scale_rewards="batch")
        with pytest.raises(ConfigError, match="scale_rewards"):
            ConduitGRPOTrainer(model=grpo_task.tiny_llama(vocab_size=len(tok)), args=cfg,
                               reward_funcs=grpo_task.reward_fn("target"),
                               train_dataset=grpo_task.prompt_dataset(n=8, prompt_len=4, seed=0),
                               processing_class=tok)


def _train_with_accumulation(monkeypatch, args, ga, **trainer_kwargs):
    """``train(args)`` with ``gradient_accumulation_steps=ga``; also which of the mini-batches
    compute_loss got carried old log-probs (in training order)."""
    import trl

    config = trl.GRPOConfig

    def with_ga(**kw):
        return config(**{**kw, "gradient_accumulation_steps": ga})

    monkeypatch.setattr(trl, "GRPOConfig", with_ga)
    carried = []

    def hook(trainer):
        compute_loss = trainer.compute_loss

        def spy(model, inputs, *a, **k):
            carried.append(inputs.get("old_per_token_logps") is not None)
            return compute_loss(model, inputs, *a, **k)
        trainer.compute_loss = spy

    return train(args, hook=hook, trainer_kwargs=trainer_kwargs), carried


@pytest.mark.parametrize("pad", ["minibatch", "iteration"])
def test_old_logprobs_where_iterations_do_not_start_on_an_optimizer_step(monkeypatch, pad):
    # ga=2, steps_per_generation=3: iterations begin at micro-steps 0, 3, 6, so the one at 3
    # shares its optimizer step with the previous iteration's last mini-batch, and its second
    # mini-batch (micro-step 4) is trained after an update: it needs the generating policy's
    # log-probs, not the learner's own (before the fix it got none: ratio 1, a wrong loss).
    args = dataclasses.replace(SMALL, steps=4, batch_size=4, steps_per_generation=3,
                               max_completion_length=6, hidden=32, layers=1, lr=0.05, seed=1)
    ref, ref_carried = _train_with_accumulation(monkeypatch, dataclasses.replace(
        args, buffer="trl"), 2)
    got, got_carried = _train_with_accumulation(monkeypatch, dataclasses.replace(
        args, buffer="conduit"), 2, pad_completions_to=pad)
    assert ref_carried == [True] * 8  # TRL computes them for every mini-batch
    # Conduit: all but those trained before their iteration's first optimizer step (whose
    # old log-probs are the learner's own, detached)
    assert got_carried == [False, False, True, False, True, True, False, False]
    assert len(ref.losses) == args.steps
    # the same up to float rounding: TRL computes old log-probs over the whole generation
    # batch, Conduit per mini-batch, and kernels may round a row differently with other rows
    torch.testing.assert_close(got.losses, ref.losses, rtol=1e-5, atol=1e-6)
    assert ref.rewards == got.rewards
    for k in ref.params:
        torch.testing.assert_close(got.params[k], ref.params[k], rtol=1e-4, atol=1e-6)
    assert got.trainer._conduit is None


@pytest.mark.parametrize(("kw", "field"), [
    ({"pad_completions_to": "max"}, "pad_completions_to"),
    ({"conduit_schedule": "overlapped"}, "conduit_schedule"),
    ({"conduit_schedule": 1}, "conduit_schedule")])
def test_conduit_arguments_are_checked_by_the_constructor(kw, field):
    from trl import GRPOConfig

    from conduit.integrations.trl import ConduitGRPOTrainer

    tok = grpo_task.digit_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=8, num_generations=4,
                         use_cpu=True, report_to="none")
        with pytest.raises(ConfigError) as err:
            ConduitGRPOTrainer(model=grpo_task.tiny_llama(vocab_size=len(tok)), args=cfg,
                               reward_funcs=grpo_task.reward_fn("target"),
                               train_dataset=grpo_task.prompt_dataset(n=8, prompt_len=4, seed=0),
                               processing_class=tok, **kw)
    assert err.value.field == field

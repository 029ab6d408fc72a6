"""ConduitGRPOTrainer as a drop-in for TRL's GRPOTrainer: training-time randomness is refused
where old log-probs are computed, reward functions may draw from torch's RNG, generation
kwargs may raise the completion limit, errors are TRL's, the old policy's copy is freed, the
refused settings are checked before TRL's constructor, and later epochs reuse log-probs."""

import dataclasses
import gc
import tempfile
import weakref

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames

from conduit.errors import ConfigError, OperatorError, SpecError  # noqa: E402
from conduit.integrations.grpo import GroupExperiencePath, LogProbSource  # noqa: E402
from conduit.workloads import grpo_task  # noqa: E402
from conduit.workloads.grpo import Args, build_trainer, train  # noqa: E402
from tests.integrations.trl_helpers import construct_trainer  # noqa: E402

#: 8 rows per generation batch in 2 mini-batches; gradient_accumulation_steps defaults to 1,
#: so TRL computes old log-probs (1 is not a multiple of 2).
SMALL = Args(steps=4, batch_size=8, num_generations=4, steps_per_generation=2,
             max_completion_length=8, seed=3)
VOCAB = len(grpo_task.digit_tokenizer())
TARGET = grpo_task.reward_fn("target")


def _with_config(monkeypatch, **overrides):
    """Make ``build_trainer`` (and ``train``) pass ``overrides`` to ``trl.GRPOConfig``."""
    import trl

    config = trl.GRPOConfig
    monkeypatch.setattr(trl, "GRPOConfig", lambda **kw: config(**{**kw, **overrides}))


def _with_reward(monkeypatch, fn):
    """Make ``build_trainer`` (and ``train``) train on the reward function ``fn``."""
    monkeypatch.setattr(grpo_task, "reward_fn", lambda task: fn)


def _assert_same_training(ref, got):
    assert len(ref.losses) == ref.args.steps
    assert ref.losses == got.losses  # exactly, not to a tolerance
    assert ref.rewards == got.rewards
    assert ref.params.keys() == got.params.keys()
    for k in ref.params:
        assert torch.equal(ref.params[k], got.params[k]), k


def _both(args):
    ref = train(dataclasses.replace(args, buffer="trl"))
    got = train(dataclasses.replace(args, buffer="conduit"))
    return ref, got




# -- training-time randomness where old log-probs are computed -------------------------------


def _tiny_opt(layerdrop):
    """A tiny random-init OPT whose only training-time randomness is ``layerdrop`` (each
    decoder layer is skipped with that probability, drawn with ``torch.rand`` in training)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(
        vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
        word_embed_proj_dim=16, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=layerdrop, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))
    model.generation_config.pad_token_id = 0
    return model


def _tiny_dbrx(resid_pdrop):
    """A tiny random-init DBRX whose residual dropout is a number its blocks keep
    (``resid_pdrop``, applied with ``F.dropout``; no dropout module)."""
    from transformers import DbrxConfig, DbrxForCausalLM

    torch.manual_seed(0)
    model = DbrxForCausalLM(DbrxConfig(
        vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=1, max_seq_len=64,
        resid_pdrop=resid_pdrop, emb_pdrop=0.0,
        attn_config={"attn_pdrop": 0.0, "kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1},
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.generation_config.pad_token_id = 0
    return model


def _llama_reading_dropout_from_its_config():
    """``grpo_task.tiny_llama`` whose first MLP drops out with a probability read at forward
    time from the model's config (as BLT reads ``self.config.dropout``): no dropout module, no
    number kept under a dropout-like name."""
    model = grpo_task.tiny_llama(vocab_size=VOCAB, hidden=32, layers=1)
    config = model.config

    def hook(module, inputs, output):
        return torch.nn.functional.dropout(output, p=config.mlp_p, training=module.training)

    config.mlp_p = 0.25
    model.model.layers[0].mlp.register_forward_hook(hook)
    return model


@pytest.mark.parametrize(("build", "field"), [(_tiny_opt, "layerdrop"),
                                              (_tiny_dbrx, "resid_pdrop")],
                         ids=["opt-layerdrop", "dbrx-resid_pdrop"])
def test_stochastic_numbers_other_than_dropout_are_refused_where_old_logprobs_are_computed(
        build, field):
    with pytest.raises(ConfigError) as err:
        construct_trainer(build(0.5), gradient_accumulation_steps=1, disable_dropout=True)
    assert err.value.field == field
    assert "random numbers in training" in str(err.value)
    # at 0 the setting draws nothing: accepted
    trainer = construct_trainer(build(0.0), gradient_accumulation_steps=1, disable_dropout=True)
    assert trainer._needs_old_logps()
    # without old log-probs both trainers draw the same numbers in their updates: accepted
    trainer = construct_trainer(build(0.5), gradient_accumulation_steps=2, disable_dropout=True)
    assert not trainer._needs_old_logps()


def test_layerdrop_trains_as_trl_where_no_old_logprobs_are_computed(monkeypatch):
    # The refusal above is confined to where it matters: with gradient_accumulation_steps a
    # multiple of steps_per_generation, layer drop draws the same numbers in both trainers.
    monkeypatch.setattr(grpo_task, "tiny_llama", lambda **kw: _tiny_opt(0.5))
    _with_config(monkeypatch, gradient_accumulation_steps=SMALL.steps_per_generation)
    ref, got = _both(dataclasses.replace(SMALL, steps=2))
    assert got.trainer.model.model.decoder.layerdrop == 0.5
    _assert_same_training(ref, got)


def test_randomness_found_only_by_a_training_mode_forward_is_refused():
    with pytest.raises(ConfigError) as err:
        construct_trainer(_llama_reading_dropout_from_its_config(), gradient_accumulation_steps=1)
    assert err.value.field == "model"
    assert "training-mode forward" in str(err.value)
    trainer = construct_trainer(_llama_reading_dropout_from_its_config(),
                                gradient_accumulation_steps=2)
    assert not trainer._needs_old_logps()


def test_the_training_mode_probe_leaves_rng_modes_and_buffers_as_they_were():
    trainer = construct_trainer(grpo_task.tiny_llama(vocab_size=VOCAB, hidden=32, layers=1),
                                gradient_accumulation_steps=1)
    model = trainer.model
    model.eval()
    model.model.layers[0].mlp.train()
    modes = [m.training for m in model.modules()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    assert trainer._draws_in_training() is False
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, i, o: torch.nn.functional.dropout(o, p=0.5, training=m.training))
    assert trainer._draws_in_training() is True
    assert torch.equal(torch.get_rng_state(), rng)  # the forward ran on a forked state


# -- reward functions that draw from torch's RNG ---------------------------------------------


def _jittered(base):
    """``base`` plus a jitter drawn from torch's global RNG."""
    def reward(prompts, completions, **kw):
        return [r + 0.1 * float(torch.rand(())) for r in base(prompts, completions, **kw)]
    return reward


def test_reward_function_drawing_from_torchs_rng_trains_as_trl(monkeypatch):
    # TRL scores the generation batch, then draws its shuffle: the permutation follows the
    # reward function's draws, and so must the Conduit path's
    _with_reward(monkeypatch, _jittered(TARGET))
    ref, got = _both(SMALL)
    _assert_same_training(ref, got)


# -- generation kwargs above max_completion_length --------------------------------------------


def test_generation_kwargs_max_new_tokens_above_max_completion_length_trains_as_trl(
        monkeypatch):
    # TRL's generation config takes max_new_tokens from generation_kwargs over
    # max_completion_length: completions may be longer than max_completion_length
    _with_config(monkeypatch, generation_kwargs={"max_new_tokens": 8})
    ref, got = _both(dataclasses.replace(SMALL, max_completion_length=3))
    _assert_same_training(ref, got)
    longest = max(h["completions/max_length"] for h in got.trainer.state.log_history
                  if "completions/max_length" in h)
    assert longest > 3


# -- errors as TRL raises them ---------------------------------------------------------------


def _raising(prompts, completions, **_):
    raise ValueError("the judge is unavailable")


def _one_short(prompts, completions, **_):
    return [0.0] * (len(completions) - 1)


def _infinite(prompts, completions, **_):
    return [float("inf")] + [0.0] * (len(completions) - 1)


def _train_error(monkeypatch, buffer, reward):
    """What training ``buffer``'s trainer on ``reward`` raises, and the trainer."""
    _with_reward(monkeypatch, reward)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(dataclasses.replace(SMALL, buffer=buffer), output_dir=tmp)
        with pytest.raises(Exception) as err:
            trainer.train()
    return err.value, trainer


@pytest.mark.parametrize(("reward", "match"), [
    (_raising, "the judge is unavailable"),
    (_one_short, "returned 15 rewards, but 16 were expected")], ids=["raises", "one-short"])
def test_reward_function_errors_reach_the_caller_as_trl_raises_them(monkeypatch, reward, match):
    want, _ = _train_error(monkeypatch, "trl", reward)
    got, trainer = _train_error(monkeypatch, "conduit", reward)
    assert type(got) is type(want) is ValueError
    assert str(got) == str(want)
    assert match in str(got)
    assert trainer._conduit is None  # the plane closed with train()
    # the trainer trains again once the reward function is mended
    trainer.reward_funcs = [TARGET]
    trainer.train()
    assert trainer._conduit is None
    assert any("loss" in h for h in trainer.state.log_history)


def test_an_infinite_reward_is_refused_as_a_spec_error(monkeypatch):
    got, trainer = _train_error(monkeypatch, "conduit", _infinite)
    assert type(got) is SpecError and not isinstance(got, OperatorError)
    assert got.field == "rewards" and "infinite" in str(got)
    assert trainer._conduit is None


# -- the old policy's copy ------------------------------------------------------------------


def test_old_policy_copy_is_freed_when_train_returns_and_rebuilt_by_the_next(monkeypatch):
    refs, carried = [], []

    def hook(trainer):
        compute_loss = trainer.compute_loss

        def spy(model, inputs, *a, **k):
            if trainer._old_policy is not None:
                refs.append(weakref.ref(trainer._old_policy))
            carried.append(inputs.get("old_per_token_logps") is not None)
            return compute_loss(model, inputs, *a, **k)
        trainer.compute_loss = spy

    got = train(dataclasses.replace(SMALL, buffer="conduit"), hook=hook)
    trainer = got.trainer
    assert refs and any(carried)  # old log-probs were computed on the copy
    gc.collect()
    assert all(r() is None for r in refs)
    assert trainer._old is None and trainer._old_policy is None
    refs.clear()
    carried.clear()
    trainer.train()
    assert refs and any(carried)  # rebuilt for the next train()
    gc.collect()
    assert all(r() is None for r in refs)


# -- refused settings before TRL's constructor -------------------------------------------------


def _tool(x: int) -> int:
    """A tool.

    Args:
        x: A number.
    """
    return x


class _Environment:
    def reset(self, **kwargs):
        return None


@pytest.mark.parametrize(("config", "trainer_args", "field"), [
    ({"use_vllm": True}, {}, "use_vllm"),
    ({"scale_rewards": "batch"}, {}, "scale_rewards"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, {}, "multi_objective_aggregation"),
    ({"mask_truncated_completions": True}, {}, "mask_truncated_completions"),
    ({"pad_to_multiple_of": 8}, {}, "pad_to_multiple_of"),
    ({"sync_ref_model": True}, {}, "sync_ref_model"),
    ({}, {"tools": [_tool]}, "tools"),
    ({}, {"rollout_func": lambda prompts, trainer: {}}, "rollout_func"),
    ({}, {"environment_factory": _Environment}, "environment_factory"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_refused_settings_are_checked_before_trls_constructor(monkeypatch, config, trainer_args,
                                                               field):
    from trl import GRPOTrainer

    def trl_init(self, *a, **k):
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    model = grpo_task.tiny_llama(vocab_size=VOCAB, hidden=32, layers=1)
    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    with pytest.raises(ConfigError) as err:
        construct_trainer(model, trainer_args=trainer_args, **config)
    assert err.value.field == field


def test_refused_settings_in_positional_arguments_are_checked_before_trls_constructor(
        monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    from conduit.integrations.trl import ConduitGRPOTrainer

    def trl_init(self, *a, **k):
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    model = grpo_task.tiny_llama(vocab_size=VOCAB, hidden=32, layers=1)
    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=4, num_generations=4,
                         use_cpu=True, report_to="none", scale_rewards="batch")
        with pytest.raises(ConfigError) as err:
            ConduitGRPOTrainer(model, grpo_task.reward_fn("target"), cfg)
    assert err.value.field == "scale_rewards"


# -- log-probs once per generation batch ---------------------------------------------------


def test_later_epochs_reuse_the_logprobs_of_their_minibatch():
    calls = {"reused": 0, "recomputed": 0}

    def logps(name):
        def fn(pids, pmask, cids, cmask):
            calls[name] += 1
            return cids.to(torch.float32) * 0.5
        return fn

    g, groups, m, epochs = 4, 3, 2, 3
    sources = [LogProbSource("old_per_token_logps", logps("reused"), reuse_across_epochs=True),
               LogProbSource("ref_per_token_logps", logps("recomputed"))]
    with GroupExperiencePath(group_size=g, groups=groups, num_minibatches=m, num_epochs=epochs,
                             max_prompt_length=4, max_completion_length=8, pad_token_id=0,
                             score=lambda payload, p, c: torch.arange(len(c), dtype=torch.float),
                             logprobs=sources, timeout=20) as path:
        for it in range(2):
            path.begin_iteration(torch.randperm(g * groups), prompt_width=2)
            for k in range(groups):
                path.push_group(prompt_ids=[[1 + k, 2]] * g,
                                completion_ids=[[5] * (1 + (i + it) % 5) for i in range(g)])
            batches = [path.pull() for _ in range(m * epochs)]
            for b in batches:
                assert torch.equal(b["old_per_token_logps"], b["completion_ids"].float() * 0.5)
                assert torch.equal(b["ref_per_token_logps"], b["completion_ids"].float() * 0.5)
            assert path._plan.reused == {}  # released with each mini-batch's last epoch
    assert calls == {"reused": 2 * m, "recomputed": 2 * m * epochs}


def test_reuse_across_epochs_must_be_a_bool():
    with pytest.raises(ConfigError) as err:
        GroupExperiencePath(group_size=2, groups=1, num_minibatches=1, num_epochs=2,
                            max_prompt_length=2, max_completion_length=2, pad_token_id=0,
                            score=lambda *a: torch.zeros(2),
                            logprobs=[LogProbSource("x", lambda *a: None,
                                                    reuse_across_epochs=1)])
    assert err.value.field == "logprobs[0].reuse_across_epochs"


def test_trainer_computes_old_and_reference_logprobs_once_per_generation_batch():
    args = dataclasses.replace(SMALL, buffer="conduit", num_iterations=2, beta=0.05)
    calls = []

    def hook(trainer):
        logps_of = trainer._logps_of

        def counting(model):
            fn = logps_of(model)

            def counted(*a):
                calls.append(model is trainer.ref_model)
                return fn(*a)
            return counted
        trainer._logps_of = counting

    got = train(args, hook=hook)
    generations = args.steps // (args.steps_per_generation * args.num_iterations)
    per_source = generations * args.steps_per_generation  # once per mini-batch
    assert calls.count(True) == per_source and calls.count(False) == per_source
    assert len(got.losses) == args.steps

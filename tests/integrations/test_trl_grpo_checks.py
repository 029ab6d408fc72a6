"""ConduitGRPOTrainer's constructor refuses what it cannot train as TRL's GRPOTrainer does, and
a schedule its plane cannot run, before training starts."""

import dataclasses
import tempfile
from fractions import Fraction

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames

from conduit.errors import ConfigError, ScheduleError  # noqa: E402
from conduit.scheduling.space import Schedule  # noqa: E402
from conduit.workloads import grpo_task  # noqa: E402
from conduit.workloads.grpo import Args, build_trainer, train  # noqa: E402
from tests.integrations.trl_helpers import construct_trainer  # noqa: E402

_tiny_llama = grpo_task.tiny_llama
SMALL = Args(steps=4, batch_size=4, num_generations=4, steps_per_generation=2,
             max_completion_length=6, hidden=32, layers=1, lr=0.05, seed=1)


def _with_config(monkeypatch, **overrides):
    """Make ``build_trainer`` (and ``train``) pass ``overrides`` to ``trl.GRPOConfig``."""
    import trl

    config = trl.GRPOConfig
    monkeypatch.setattr(trl, "GRPOConfig", lambda **kw: config(**{**kw, **overrides}))




def _gpt2_with_dropout():
    """A tiny random-init GPT-2: its dropout is ``torch.nn.Dropout`` modules with p = 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = len(grpo_task.digit_tokenizer())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1,
                                       n_head=2, bos_token_id=1, eos_token_id=2,
                                       pad_token_id=0))
    model.generation_config.pad_token_id = 0
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    return model


def _llama_with_attention_dropout(**kw):
    """``grpo_task.tiny_llama`` with attention dropout 0.2, a probability the attention modules
    keep as a number (no ``torch.nn.Dropout``, so TRL's ``disable_dropout`` leaves it)."""
    model = _tiny_llama(**kw)
    model.config.attention_dropout = 0.2
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.2
    return model


def test_sync_ref_model_is_refused(monkeypatch):
    # TRL computes the reference log-probs of a generation batch at generation; the path
    # computes them per mini-batch in delivery, after SyncRefModelCallback may have moved the
    # reference model, so the KL term (and the loss) would differ
    _with_config(monkeypatch, sync_ref_model=True, ref_model_sync_steps=1,
                 ref_model_mixup_alpha=0.9)
    args = dataclasses.replace(SMALL, beta=0.5, buffer="conduit")
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(ConfigError) as err:
        build_trainer(args, output_dir=tmp)
    assert err.value.field == "sync_ref_model"
    assert "set it to False" in str(err.value)


def test_dropout_is_refused_where_old_logprobs_are_computed_unless_disabled():
    # gradient_accumulation_steps=1 < steps_per_generation=2: TRL computes old log-probs, in
    # training mode (dropout masks drawn from torch's RNG), which the path does not reproduce
    with pytest.raises(ConfigError) as err:
        construct_trainer(_gpt2_with_dropout(), gradient_accumulation_steps=1)
    assert err.value.field == "disable_dropout"
    assert "disable_dropout=True" in str(err.value)
    trainer = construct_trainer(_gpt2_with_dropout(), gradient_accumulation_steps=1,
                                disable_dropout=True)
    assert trainer._needs_old_logps()


def test_dropout_that_disable_dropout_leaves_is_refused_where_old_logprobs_are_computed():
    for disable in (False, True):
        with pytest.raises(ConfigError) as err:
            construct_trainer(
                _llama_with_attention_dropout(vocab_size=len(grpo_task.digit_tokenizer())),
                gradient_accumulation_steps=1, disable_dropout=disable)
        assert err.value.field == "attention_dropout"


def test_dropout_without_old_logprobs_trains_as_trl(monkeypatch):
    # gradient_accumulation_steps = steps_per_generation: no old log-probs, so dropout draws
    # the same masks in both trainers' updates, in the same order; the setting is accepted and
    # the losses and updates are TRL's
    monkeypatch.setattr(grpo_task, "tiny_llama", _llama_with_attention_dropout)
    _with_config(monkeypatch, gradient_accumulation_steps=SMALL.steps_per_generation)
    args = dataclasses.replace(SMALL, steps=4)
    ref = train(dataclasses.replace(args, buffer="trl"))
    got = train(dataclasses.replace(args, buffer="conduit"))
    assert got.trainer.model.model.layers[0].self_attn.attention_dropout == 0.2
    assert any(x != 0 for x in ref.losses)
    assert ref.losses == got.losses
    for k in ref.params:
        assert torch.equal(ref.params[k], got.params[k]), k


def test_infeasible_conduit_schedule_is_refused_by_the_constructor():
    # 8 rows in 2 mini-batches: on-policy delivery runs one mini-batch (1/2) per invocation
    args = dataclasses.replace(SMALL, buffer="conduit")
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(ScheduleError) as err:
        build_trainer(args, output_dir=tmp, conduit_schedule=Schedule(0, 1, 1, Fraction(1, 3)))
    assert "conduit_schedule" in str(err.value)
    assert "g_del" in str(err.value) and "{1/2}" in str(err.value)


@pytest.mark.parametrize("schedule", [
    Schedule(1, 1, 0, Fraction(1, 2)),
    Schedule(0, Fraction(1, 4), 1, Fraction(1, 2)),  # one group (4 of 16 rows) per ingestion
])
def test_feasible_conduit_schedules_are_accepted(schedule):
    args = dataclasses.replace(SMALL, batch_size=8, buffer="conduit")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, output_dir=tmp, conduit_schedule=schedule)
    assert trainer._conduit_schedule == schedule


def _mixtral_with_router_jitter(*, vocab_size, hidden=32, layers=1, heads=4, max_positions=64,
                                seed=0):
    """A tiny random Mixtral whose router adds jitter noise in training (a probability-like
    number its MoE blocks keep; no dropout module)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=heads, max_position_embeddings=max_positions,
                        num_local_experts=2, num_experts_per_tok=1, router_jitter_noise=0.1,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    return model


def test_router_jitter_is_refused_where_old_logprobs_are_computed():
    # TRL computes old log-probs in training mode, where the router's jitter draws from torch's
    # RNG (and moves the next shuffle): the path's eval-mode snapshot would differ
    vocab = len(grpo_task.digit_tokenizer())
    with pytest.raises(ConfigError) as err:
        construct_trainer(_mixtral_with_router_jitter(vocab_size=vocab),
                          gradient_accumulation_steps=1, disable_dropout=True)
    assert "jitter" in err.value.field and "random numbers in training" in str(err.value)
    trainer = construct_trainer(_mixtral_with_router_jitter(vocab_size=vocab),
                                gradient_accumulation_steps=2)  # a multiple of 2: no old log-probs
    assert not trainer._needs_old_logps()

#!/usr/bin/env bash
# GPU check: the GPU tests, the placement benchmark, the reference workloads and the demo,
# prepared for a lent device machine. One call of the device tool, run from the repository
# root:
#     bash scripts/gpu_check.sh
# It needs no network: the venv reuses the machine's CUDA torch (--system-site-packages) and the
# project is installed without dependencies. Packages the machine lacks travel as wheels in
# .whl (carry it): Gymnasium, for the workloads. Prepare them here once:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 -d .whl \
#         gymnasium==1.2.2 farama-notifications==0.0.6
# Ray's wheel (79 MB) is over what a call carries, so the workloads run their rollout workers
# in-process (--no-use-ray); conduit never imports Ray on that path.
#
# Everything it writes lands under $OUT (8 files, two folders deep: the device tool's limit),
# or runs/gpu_check when OUT is unset:
#     $OUT/env.txt                     GPU, driver, torch
#     $OUT/tests.log                   pytest -m gpu, then tests/plane tests/storage with CUDA
#     $OUT/bench.log                   the three benchmarks' tables and progress
#     $OUT/bench/placement.json|png    conduit bench placement
#     $OUT/workloads/workloads.json|png  conduit bench workloads, heavy rows
#     $OUT/demo/demo.json              conduit demo (its PNG is dropped: the 8-file limit)
# A second call, PARTS=convergence (over 10 minutes would not fit the first), adds
#     $OUT/convergence/convergence.json|png  conduit bench convergence
# Knobs (environment): PARTS (default "tests placement workloads demo"), BENCH_ARGS (extra
# flags for the placement bench, default "--max-buffer-gb 4 --shards 2"), WORKLOAD_ARGS
# (default "--rounds 2 --iters 24"), DEMO_ARGS (default "--rounds 2 --iters 30"), QUICK=1
# (smoke run: --quick placement bench, only the GPU tests), PYTHON (interpreter), SKIP_VENV=1
# (use PYTHON as is, with PYTHONPATH=src; the default when PYTHON is itself a virtualenv, as
# the device image's python3 is: a venv made from a venv does not see its packages),
# CONVERGENCE_ARGS (default "--ppo-iters 80 --dqn-iters 250"). Each part has a time limit in
# seconds: LIMIT_TESTS (the GPU tests, 40), LIMIT_SUITE (tests/plane and tests/storage, 150),
# LIMIT_PLACEMENT (60), LIMIT_WORKLOADS (240), LIMIT_DEMO (80), LIMIT_CONVERGENCE (420). On
# one H200 the GPU tests took 15-20 s, the placement bench 25-45 s, the workloads about 215 s
# and the demo 20-40 s; the suite was half done after 60 s; a fresh machine took about 35 s
# to start. Run it with timeout_s=600.
set -uo pipefail
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
VENV=${VENV:-/tmp/conduit-gpu-venv}
status=0

: >"$OUT/env.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== carried wheels: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>>"$OUT/env.txt" || status=1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${SKIP_VENV:-}" ]; then
    # A venv made with --system-site-packages sees the base interpreter's packages, not those
    # of a venv it was made from.
    SKIP_VENV=$("$PY" -c "import sys; print(int(sys.prefix != sys.base_prefix))" 2>/dev/null \
        || echo 0)
fi
if [ "$SKIP_VENV" = "1" ]; then
    echo "== using $PY as is (SKIP_VENV=1)"
    VPY="$PY"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "== venv"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv --system-site-packages "$VENV" || exit 2
    fi
    VPY="$VENV/bin/python"
    if ! "$VPY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
            2>>"$OUT/env.txt"; then
        echo "pip install failed; falling back to PYTHONPATH=src" | tee -a "$OUT/env.txt"
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
{
    nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
    "$VPY" - <<'PY'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    print(f"cuda:{i}", torch.cuda.get_device_name(i), f"free {free/2**30:.1f} / {total/2**30:.1f} GiB")
PY
} >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

PARTS=${PARTS:-tests placement workloads demo}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# run LIMIT LOG CMD...: CMD under a time limit, its output shown and appended to LOG.
run() {
    local limit=$1 log=$2
    shift 2
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "!! stopped after ${limit}s: $*" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

if want tests; then
    echo "== pytest -m gpu" | tee "$OUT/tests.log"
    run "${LIMIT_TESTS:-40}" "$OUT/tests.log" "$VPY" -m pytest -m gpu -q -rs -p no:cacheprovider
    if [ "${QUICK:-0}" != "1" ]; then
        echo "== tests/plane tests/storage with CUDA present" | tee -a "$OUT/tests.log"
        run "${LIMIT_SUITE:-150}" "$OUT/tests.log" \
            "$VPY" -m pytest tests/plane tests/storage -q -rs -p no:cacheprovider
    fi
fi

: >"$OUT/bench.log"
if want placement; then
    echo "== conduit bench placement" | tee -a "$OUT/bench.log"
    if [ "${QUICK:-0}" = "1" ]; then
        bench_args="--quick"
    else
        bench_args=${BENCH_ARGS:---max-buffer-gb 4 --shards 2}
    fi
    # shellcheck disable=SC2086
    run "${LIMIT_PLACEMENT:-60}" "$OUT/bench.log" \
        "$VPY" -m conduit.cli bench placement $bench_args --out "$OUT/bench"
fi

if want workloads; then
    echo "== conduit bench workloads (heavy rows, in-process rollout workers)" \
        | tee -a "$OUT/bench.log"
    # shellcheck disable=SC2086
    run "${LIMIT_WORKLOADS:-240}" "$OUT/bench.log" \
        "$VPY" -m conduit.cli bench workloads --no-use-ray \
        --only DQN-img128 DQN-img256 SAC-img128 SAC-img256 PPO-img128 PPO-img256 \
        ${WORKLOAD_ARGS:---rounds 2 --iters 24} --out "$OUT/workloads"
fi

if want demo; then
    echo "== conduit demo (in-process rollout workers)" | tee -a "$OUT/bench.log"
    # shellcheck disable=SC2086
    run "${LIMIT_DEMO:-80}" "$OUT/bench.log" \
        "$VPY" -m conduit.cli demo --no-use-ray ${DEMO_ARGS:---rounds 2 --iters 30} \
        --out "$OUT/demo"
    rm -f "$OUT/demo/demo.png"
fi

if want convergence; then
    echo "== conduit bench convergence (in-process rollout workers)" | tee -a "$OUT/bench.log"
    # shellcheck disable=SC2086
    run "${LIMIT_CONVERGENCE:-420}" "$OUT/bench.log" \
        "$VPY" -m conduit.cli bench convergence --no-use-ray \
        ${CONVERGENCE_ARGS:---ppo-iters 80 --dqn-iters 250} --out "$OUT/convergence"
fi

# verl (PARTS=verl, not in the default parts): one GRPO step of verl's v1 trainer (vLLM rollout,
# FSDP actor) with Conduit as its replay buffer, on a random-init tiny Qwen2 model, a digit
# tokenizer and a digit-copying data set built here (nothing is downloaded). It needs CUDA,
# vLLM, and verl with TransferQueue (pip install conduit-rl[verl]) in $VPY, and skips with the
# reason otherwise. Writes $OUT/verl.log; passes when the step logs Conduit's metric.
if want verl; then
    echo "== verl: one GRPO step, Conduit as the v1 replay buffer" | tee "$OUT/verl.log"
    if ! "$VPY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        echo "SKIP verl: CUDA is not available" | tee -a "$OUT/verl.log"
    elif ! "$VPY" -c "import vllm" 2>/dev/null; then
        echo "SKIP verl: vLLM is not installed (verl's rollout needs it)" | tee -a "$OUT/verl.log"
    elif ! "$VPY" -c "import verl, transfer_queue" 2>/dev/null; then
        echo "SKIP verl: verl 0.9.1 and transferqueue are not installed" | tee -a "$OUT/verl.log"
    else
        VD=/tmp/conduit-verl
        run 120 "$OUT/verl.log" "$VPY" - "$VD" <<'PY'
import os, sys
import pandas as pd
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789"])}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                               unk_token="<unk>")
fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
fast.save_pretrained(f"{d}/model")
cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
Qwen2ForCausalLM(cfg).save_pretrained(f"{d}/model")
rows = [{"data_source": "digits", "prompt": [{"role": "user", "content": f"{i % 10}{i % 7}"}],
         "ability": "copy", "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
         "extra_info": {"index": i}} for i in range(64)]
pd.DataFrame(rows).to_parquet(f"{d}/train.parquet")
with open(f"{d}/reward.py", "w") as f:
    f.write("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    return float(solution_str[:1] == ground_truth)\n")
PY
        run "${LIMIT_VERL:-420}" "$OUT/verl.log" "$VPY" -m verl.trainer.main_ppo \
            algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
            data.train_files="$VD/train.parquet" data.val_files="$VD/train.parquet" \
            data.train_batch_size=4 data.max_prompt_length=8 data.max_response_length=8 \
            actor_rollout_ref.model.path="$VD/model" \
            actor_rollout_ref.actor.ppo_mini_batch_size=4 \
            actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
            actor_rollout_ref.actor.use_kl_loss=False \
            actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 \
            actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
            actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
            actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
            reward.custom_reward_function.path="$VD/reward.py" \
            reward.custom_reward_function.name=compute_score \
            trainer.use_v1=True trainer.v1.trainer_mode=sync trainer.balance_batch=False \
            trainer.v1.sampler.custom_sampler.path=pkg://conduit.integrations.verl.replay \
            trainer.v1.sampler.custom_sampler.name=ConduitReplayBuffer \
            +trainer.v1.sampler.sampler_kwargs.group_size=4 \
            +trainer.v1.sampler.sampler_kwargs.mini_batch_size=8 \
            trainer.total_training_steps=1 trainer.val_before_train=False \
            trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger='[console]' \
            trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.default_local_dir="$VD/ckpt"
        if grep -q "training/conduit/score_mean" "$OUT/verl.log"; then
            echo "verl: the step ran through Conduit's replay buffer" | tee -a "$OUT/verl.log"
        else
            echo "!! verl: no Conduit metric in the step's log" | tee -a "$OUT/verl.log"
            status=1
        fi
    fi
fi

echo "== done (status $status); outputs under $OUT"
exit $status

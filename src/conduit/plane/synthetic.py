"""A synthetic training loop over the plane, to profile and benchmark it without a real job
(``conduit plan --profile``, ``conduit bench plane`` and ``conduit bench schedule``).

A policy MLP forward over freshly generated observations is the rollout; an MLP forward and
backward on the delivered batch is the update. Ingestion (transition assembly and
normalisation, reward-to-go on-policy) and delivery (concatenate, reshape) are registered as the
plane's operators, so the experience path does real work on real tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from conduit.plane import ExperienceDataPlane
from conduit.spec import ExperienceSpec


def synthetic_spec(dim: int) -> ExperienceSpec:
    """Buffer spec of the synthetic workload: ``obs``/``next_obs`` of ``dim`` float32 values
    plus action, reward, done and advantage."""
    return ExperienceSpec.of(obs=((dim,), torch.float32), next_obs=((dim,), torch.float32),
                             action=((), torch.int64), reward=((), torch.float32),
                             done=((), torch.bool), advantage=((), torch.float32))


class Workload:
    """Policy and learner MLPs: the rollout and update compute.

    Args:
        dim: Observation dimension.
        hidden: Hidden width of both MLPs.
        seed: Seed of the weights and of the generated observations.
    """

    def __init__(self, dim: int, hidden: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.policy = [torch.randn(dim, hidden, generator=g) / dim ** 0.5,
                       torch.randn(hidden, 8, generator=g) / hidden ** 0.5]
        self.learner = torch.nn.Sequential(torch.nn.Linear(2 * dim, hidden), torch.nn.ReLU(),
                                           torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                           torch.nn.Linear(hidden, 1))
        self.opt = torch.optim.SGD(self.learner.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def rollout(self, rows: int) -> dict[str, torch.Tensor]:
        """One rollout unit of ``rows`` steps."""
        obs = torch.randn(rows, self.dim, generator=self.gen)
        logits = torch.relu(obs @ self.policy[0]) @ self.policy[1]
        return {"obs": obs, "action": logits.argmax(1),
                "reward": logits.max(1).values, "done": torch.zeros(rows, dtype=torch.bool)}

    def update(self, batch: dict[str, torch.Tensor]) -> float:
        """One SGD step on a delivered batch; returns the loss."""
        x = batch["x"]
        loss = (self.learner(x).squeeze(1) - batch["target"]).pow(2).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def register_ops(plane: ExperienceDataPlane, *, on_policy: bool) -> None:
    """Register the synthetic ingestion and delivery operators on ``plane``."""
    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        for d in actor_in.read_units():
            obs = d["obs"]
            # Transition assembly (obs, next_obs) and observation normalisation, as a framework's
            # episode-to-transition conversion would do.
            mean, std = obs.mean(0), obs.std(0) + 1e-6
            norm = (obs - mean) / std
            reward = d["reward"]
            if on_policy:
                # Discounted reward-to-go as a stand-in for GAE, vectorised over the segment.
                t = torch.arange(reward.shape[0], dtype=torch.float32)
                disc = torch.pow(0.99, t)
                adv = torch.flip(torch.cumsum(torch.flip(reward * disc, [0]), 0), [0]) / disc
            else:
                adv = torch.zeros_like(reward)
            next_obs = torch.cat([norm[1:], norm[-1:]])  # the segment's last step bootstraps
            exp_out.write({"obs": norm, "next_obs": next_obs, "action": d["action"],
                           "reward": reward, "done": d["done"], "advantage": adv})

    @plane.register_delivery(input="ExperienceBuffer", output="Learner")
    def delivery(exp_in, learn_out):
        d = exp_in.read()
        # Concatenate and reshape into the learner's input layout.
        x = torch.cat([d["obs"], d["next_obs"]], dim=1)
        target = d["reward"] + d["advantage"]
        if on_policy:
            target = (target - target.mean()) / (target.std() + 1e-6)
        learn_out.write({"x": x, "target": target, "_index": d["_index"]})


def make_step(work: Workload, *, rollout_rows: int, on_policy: bool = False,
              onpolicy_units: int = 1) -> Callable[[ExperienceDataPlane], dict[str, float]]:
    """One training iteration of the synthetic loop, as a function of the plane.

    Off-policy: one rollout unit pushed, one batch pulled, one update; rollout and update run
    inside ``plane.timed("rollout")`` / ``plane.timed("update")``. On-policy:
    ``onpolicy_units`` rollout units pushed (tagged with the plane's policy version), then every
    mini-batch of the iteration pulled and trained on; the summed rollout and update compute of
    the iteration are recorded once each as ``"rollout"`` / ``"update"``.

    Returns:
        ``step(plane) -> {"rollout": s, "update": s}``: the compute seconds of that iteration.
    """
    def step(plane: ExperienceDataPlane) -> dict[str, float]:
        t_roll = t_upd = 0.0
        if on_policy:
            # One "rollout" and one "update" record per iteration: the cost model's T_rollout
            # and T_update are the whole phases of an on-policy iteration.
            version = plane.policy_version
            start = time.perf_counter()
            for _ in range(onpolicy_units):
                a = time.perf_counter()
                r = work.rollout(rollout_rows)
                t_roll += time.perf_counter() - a
                plane.push(r, policy_version=version)
            plane.timings.record("rollout", t_roll, start=start)
            start = time.perf_counter()
            for mb in plane.minibatches():
                a = time.perf_counter()
                work.update(mb)
                t_upd += time.perf_counter() - a
            plane.timings.record("update", t_upd, start=start)
        else:
            a = time.perf_counter()
            with plane.timed("rollout"):
                r = work.rollout(rollout_rows)
            t_roll += time.perf_counter() - a
            plane.push(r)
            b = plane.pull()
            a = time.perf_counter()
            with plane.timed("update"):
                work.update(b)
            t_upd += time.perf_counter() - a
        return {"rollout": t_roll, "update": t_upd}
    return step


def fill(plane: ExperienceDataPlane, work: Workload, *, rollout_rows: int, units: int) -> None:
    """Push ``units`` rollout units and ingest them (an off-policy buffer past ``min_size``)."""
    for _ in range(max(1, units)):
        plane.push(work.rollout(rollout_rows))
    plane.flush()


def measure(plane: ExperienceDataPlane, step: Callable[[ExperienceDataPlane], dict[str, float]],
            *, iters: int, warmup: int) -> dict[str, float]:
    """Run ``warmup`` then ``iters`` steps; per-iteration means over the measured ones.

    Means (not medians) over a whole number of iterations, so a batched operator that runs once
    every ``g`` iterations is charged its full cost.

    Returns:
        ``{"wall", "rollout", "update", "exposed"}`` in seconds per iteration, where
        ``exposed = wall − rollout − update`` (docs/design.md §9), plus ``"iters"``.
    """
    for _ in range(warmup):
        step(plane)
    t_roll = t_upd = 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        r = step(plane)
        t_roll += r["rollout"]
        t_upd += r["update"]
    wall = time.perf_counter() - t0
    n = max(1, iters)
    return {"wall": wall / n, "rollout": t_roll / n, "update": t_upd / n,
            "exposed": max(0.0, wall - t_roll - t_upd) / n, "iters": iters}

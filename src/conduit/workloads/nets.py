"""Networks of the reference trainers: an MLP, a small convolutional encoder, and the heads.

Every network takes the observation as keyword tensors ``obs`` (float32 state) and, for the
image-payload workloads, ``pixels`` (uint8 ``N×H×W×3``). Images pass through
:class:`ConvEncoder` and are concatenated with the state.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from conduit.workloads.envs import EnvInfo


def mlp(sizes: list[int], *, activation: type[nn.Module] = nn.ReLU,
        out_gain: float | None = None) -> nn.Sequential:
    """A plain MLP; ``out_gain`` switches on orthogonal init (as PPO implementations use)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        lin = nn.Linear(sizes[i], sizes[i + 1])
        if out_gain is not None:
            last = i == len(sizes) - 2
            nn.init.orthogonal_(lin.weight, out_gain if last else np.sqrt(2))
            nn.init.zeros_(lin.bias)
        layers.append(lin)
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class ConvEncoder(nn.Module):
    """Small conv encoder for ``N×H×W×3`` uint8 images.

    Large images are first subsampled to about 32×32 by striding, so the learner's cost stays
    small and bounded as the payload grows: these workloads stress the experience path, which
    carries the full image.

    Args:
        image_size: Image side in pixels.
        features: Output features.
    """

    def __init__(self, image_size: int, features: int = 64) -> None:
        super().__init__()
        self.stride = max(1, image_size // 32)
        side = (image_size + self.stride - 1) // self.stride
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            n = self.net(torch.zeros(1, 3, side, side)).shape[1]
        self.head = nn.Sequential(nn.Linear(n, features), nn.ReLU())
        self.features = features

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels[:, ::self.stride, ::self.stride, :].permute(0, 3, 1, 2).float() / 255.0
        return self.head(self.net(x))


class Encoder(nn.Module):
    """State vector, concatenated with conv features of the image when there is one."""

    def __init__(self, info: EnvInfo) -> None:
        super().__init__()
        self.conv = ConvEncoder(info.image_size) if info.image_size else None
        self.out_dim = info.obs_dim + (self.conv.features if self.conv else 0)

    def forward(self, obs: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
        obs = obs.reshape(obs.shape[0], -1)
        if self.conv is None:
            return obs
        return torch.cat([obs, self.conv(pixels)], dim=-1)


class QNetwork(nn.Module):
    """DQN's action-value network."""

    def __init__(self, info: EnvInfo, hidden: int = 128) -> None:
        super().__init__()
        self.enc = Encoder(info)
        self.head = mlp([self.enc.out_dim, hidden, hidden, info.num_actions])

    def forward(self, obs: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.enc(obs, pixels))


class SoftQNetwork(nn.Module):
    """SAC's critic ``Q(s, a)``."""

    def __init__(self, info: EnvInfo, hidden: int = 256) -> None:
        super().__init__()
        self.enc = Encoder(info)
        self.head = mlp([self.enc.out_dim + info.action_dim, hidden, hidden, 1])

    def forward(self, obs: torch.Tensor, action: torch.Tensor,
                pixels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(torch.cat([self.enc(obs, pixels), action], dim=-1)).squeeze(-1)


LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class SACActor(nn.Module):
    """SAC's squashed-Gaussian policy, scaled to the action bounds."""

    def __init__(self, info: EnvInfo, hidden: int = 256) -> None:
        super().__init__()
        self.enc = Encoder(info)
        self.trunk = mlp([self.enc.out_dim, hidden, hidden])
        self.trunk.append(nn.ReLU())
        self.mean = nn.Linear(hidden, info.action_dim)
        self.log_std = nn.Linear(hidden, info.action_dim)
        self.register_buffer("scale", torch.tensor((info.action_high - info.action_low) / 2))
        self.register_buffer("bias", torch.tensor((info.action_high + info.action_low) / 2))

    def forward(self, obs: torch.Tensor, pixels: torch.Tensor | None = None,
                *, generator: torch.Generator | None = None,
                deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample an action; returns ``(action, log_prob)``."""
        h = self.trunk(self.enc(obs, pixels))
        mean = self.mean(h)
        log_std = torch.tanh(self.log_std(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        std = log_std.exp()
        if deterministic:
            u = mean
        else:
            u = mean + std * torch.randn(mean.shape, generator=generator, dtype=mean.dtype,
                                         device=mean.device)
        y = torch.tanh(u)
        action = y * self.scale + self.bias
        # Not validated: a diverged learner's NaN parameters give NaN losses, which the
        # trainer reports, rather than an error here.
        logp = (Normal(mean, std, validate_args=False).log_prob(u)
                - torch.log(self.scale * (1 - y.pow(2)) + 1e-6))
        return action, logp.sum(-1)


class PPOAgent(nn.Module):
    """PPO's policy and value heads over one shared encoder."""

    def __init__(self, info: EnvInfo, hidden: int = 64) -> None:
        super().__init__()
        self.enc = Encoder(info)
        self.discrete = info.discrete
        d = self.enc.out_dim
        self.critic = mlp([d, hidden, hidden, 1], activation=nn.Tanh, out_gain=1.0)
        out = info.num_actions if info.discrete else info.action_dim
        self.actor = mlp([d, hidden, hidden, out], activation=nn.Tanh, out_gain=0.01)
        if not info.discrete:
            self.log_std = nn.Parameter(torch.zeros(info.action_dim))

    def value(self, obs: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
        return self.critic(self.enc(obs, pixels)).squeeze(-1)

    def dist(self, h: torch.Tensor) -> Categorical | Normal:
        """The policy's action distribution; not validated, so NaN parameters of a diverged
        learner give NaN losses (which the trainer reports) rather than an error."""
        out = self.actor(h)
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.log_std.exp().expand_as(out), validate_args=False)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor,
                 pixels: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob(action), entropy, value)`` for a mini-batch."""
        h = self.enc(obs, pixels)
        d = self.dist(h)
        logp, ent = d.log_prob(action), d.entropy()
        if not self.discrete:
            logp, ent = logp.sum(-1), ent.sum(-1)
        return logp, ent, self.critic(h).squeeze(-1)

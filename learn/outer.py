"""DiLoCo's outer step, and the hash that shows every member holds the same state.

:class:`OuterSGD` is SGD with Nesterov momentum on the averaged
pseudo-gradient, in float32, written out so that its result depends only on
its inputs, on any CPU: every product is rounded on its own before it is
added.  (``torch.optim.SGD`` computes ``a + α·b`` with ``add(alpha=)``,
which torch fuses into one multiply-add where the CPU has FMA and not where
it does not, so two members on different CPUs would part in the last bit.)
It agrees with ``torch.optim.SGD(nesterov=True)`` to float32 rounding.
"""

from __future__ import annotations

import torch

from .tensors import dtype_name, tensor_hasher, tensor_view


class OuterSGD:
    """θ ← θ − lr·(Δ + μ·b) with b ← μ·b + Δ (Nesterov), per named tensor."""

    SPAN = 1 << 18  # values stepped per pass: the scratch holds one span (1 MiB), whatever the model

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        self.lr, self.mu, self.nesterov = lr, momentum, nesterov
        self.momentum: dict[str, torch.Tensor] = {}
        self._scratch = torch.empty(self.SPAN)  # the step of one span

    def step(self, theta: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move the entries of ``theta`` named in ``delta`` (both float32, contiguous)
        one step, in place, as the momentum buffers are (no copy of the state: a large
        model's outer step allocates nothing but a first round's momentum); returns ``theta``.
        Each span of values is taken through the whole step while it is in cache."""
        for name in sorted(delta):
            d = delta[name]
            if theta[name].dtype != torch.float32 or d.dtype != torch.float32:
                raise ValueError(f"{name}: the outer step is float32")
            fresh = name not in self.momentum
            if fresh:
                self.momentum[name] = torch.empty_like(d)
            flat_d, flat_b, flat_t = d.reshape(-1), self.momentum[name].view(-1), theta[name].view(-1)
            for at in range(0, flat_d.numel(), self.SPAN):
                end = min(at + self.SPAN, flat_d.numel())
                g, b, step = flat_d[at:end], flat_b[at:end], self._scratch[:end - at]
                if fresh:
                    b.copy_(g)
                else:
                    b.mul_(self.mu).add_(g)  # b ← μ·b + Δ
                if self.nesterov:
                    torch.mul(b, self.mu, out=step).add_(g)  # Δ + μ·b
                    step.mul_(self.lr)
                else:
                    torch.mul(b, self.lr, out=step)
                flat_t[at:end].sub_(step)
        return theta


def state_hash(*states: dict[str, torch.Tensor]) -> bytes:
    """blake3 of the states: per state, each entry in name order with its name,
    dtype, shape and bytes.  Equal exactly when every bit is."""
    hasher = tensor_hasher()
    for state in states:
        hasher.update(len(state).to_bytes(4, "little"))
        for name in sorted(state):
            tensor = state[name]
            header = f"{name}\0{dtype_name(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode()
            hasher.update(len(header).to_bytes(4, "little") + header)
            hasher.update(tensor_view(tensor))
    return hasher.digest()

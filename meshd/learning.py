"""Training across peers, for training scripts: ``import meshd.learning as ml``.

::

    async with meshd.open_node(data_dir, bootstrap=[...]) as node:
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.AdamW(model.parameters(), 3e-4),
                        group="run42", inner_steps=50)
        for batch in loader:
            model(batch).loss.backward()
            await opt.step(samples=len(batch))

``GossipAverager`` is the other algorithm: ``await avg.step()`` after each
round's local epochs.  Both need the node's ``learning`` service (on by
default); see docs/learning.md.
"""

from .services.learning.averager import GossipAverager, GossipReport
from .services.learning.diloco import DiLoCo, SyncReport

__all__ = ["DiLoCo", "GossipAverager", "GossipReport", "SyncReport"]

"""Training across peers, sans-IO: the math and the round logic, no sockets, no clock.

* :mod:`learn.tensors`: tensors to raw bytes and back (no numpy, no pickle),
  and sums whose bits do not depend on the thread count;
* :mod:`learn.encoded`, :mod:`learn.compress`: codecs none, fp16, bf16,
  blockwise int8 and int4, with error feedback;
* :mod:`learn.wire`: named tensors as bounded frames, signed contributions;
* :mod:`learn.tensorset`: a declared set of named tensors, and transfers that
  hold exactly its tensors (a training script and the daemon it trains through);
* :mod:`learn.merge`: gossip merge rules (mean, variance corrected, conservative);
* :mod:`learn.robust`: mean, trimmed mean, centered clipping;
* :mod:`learn.outer`: DiLoCo's Nesterov outer step and the state hash;
* :mod:`learn.reports`: what a DiLoCo exchange or a gossip round did;
* :mod:`learn.fragments`: Streaming DiLoCo's fragments and schedule;
* :mod:`learn.group`, :mod:`learn.gossip`, :mod:`learn.allreduce`: the
  membership view, adaptive timeouts, gossip rounds, the all-reduce with no
  coordinator (every member that finishes holds the same bits);
* :mod:`learn.simnet`: gossip averaging of many members in one process, with
  churn and slow links.

meshd's service ``learning`` is the shell that moves these over the network.
"""

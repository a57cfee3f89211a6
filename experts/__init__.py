"""Mixtures of experts served by different peers, sans-IO: the math and the
bookkeeping, no sockets, no clock (time comes in as ``now``).

* :mod:`experts.hdee`: heterogeneous domain expert ensembles of language
  models, each expert weighted by its posterior given the text so far, in one
  go or token by token, and the cached prior learnt from held-out text;
* :mod:`experts.ddm`: decentralized diffusion models, a router's weights over
  flow-matching experts (full, top-1, top-k, uniform), combining the
  velocities of the experts that answered, and the flow-matching helpers;
* :mod:`experts.batching`: dynamic batching of requests by size and waiting time;
* :mod:`experts.coalescing`: a client's concurrent calls to one expert gathered
  into fewer requests;
* :mod:`experts.servers`: which of the peers serving one expert to ask first,
  back-off after failures, and how long to wait before hedging.

meshd moves requests and answers over the network; these modules decide.
"""

"""Instant learning: R replicas of one network trained at once, and what pooling them buys.

Reconstruction of Simpson (2015), "Instant learning: parallel deep neural networks and
convolutional bootstrapping", arXiv 1505.05972, from its abstract and introduction: a DNN
is replicated many times, each replica is trained from its own starting weights, and the
replicas' predictions are integrated ("cumulative sampling of local solution space");
making each replica's copy of the training data independent (the paper names data
augmentation) is said to enhance this, under the name *convolutional bootstrapping*.

What this module implements, top to bottom:

* :func:`make_replicas` and :func:`stack`: R seeded MLPs and their parameters stacked
  along a leading replica axis (``torch.func.stack_module_state``);
* :func:`sgd_step_looped` (the serial reference: a Python loop over R models) beside
  :func:`sgd_step_batched` (one ``vmap`` of ``grad`` of a ``functional_call``): equal to
  round-off step by step when given the same data;
* pooling: :func:`ensemble_probs` (average the replicas' probabilities) and
  :func:`average_weights` (average their parameters, sound only near a shared
  initialisation), with :func:`permute_hidden` showing why (permutation symmetry);
* :func:`convolutional_bootstrap`: our reading of the paper's enhancement (see there);
* :func:`instant_learning`: accuracy vs wall time for several R; :func:`throughput` and
  :func:`bench`: replicas trained per second, batched vs looped, measured side by side.
"""

from parlearn.many_copies.replicas.pooling import (
    accuracies,
    average_weights,
    ensemble_nll,
    ensemble_probs,
    mean_replica_nll,
    permute_hidden,
    plurality_votes,
)
from parlearn.many_copies.replicas.runs import (
    BOOTSTRAPS,
    bench,
    convolutional_bootstrap,
    instant_learning,
    throughput,
    train_batched,
    train_looped,
)
from parlearn.many_copies.replicas.stacked import (
    check_stacked,
    make_replicas,
    predict,
    sgd_step_batched,
    sgd_step_looped,
    stack,
)

__all__ = ["make_replicas", "stack", "check_stacked", "sgd_step_looped", "sgd_step_batched",
           "predict", "ensemble_probs", "ensemble_nll", "mean_replica_nll", "accuracies",
           "average_weights", "permute_hidden", "plurality_votes", "convolutional_bootstrap",
           "train_batched", "train_looped", "BOOTSTRAPS", "instant_learning", "throughput", "bench"]

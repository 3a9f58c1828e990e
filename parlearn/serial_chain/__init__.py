"""Part 2 · beyond backprop's serial chain (lessons 20-29).

- ``leapfrog``: leapfrogging backprop, the delta/G split (lesson 20);
- ``multigrid``: layer-parallel ResNets by MGRIT (lesson 21);
- ``local``: local learning signals and the asynchronous block pipeline (lesson 22);
- ``neq``: NEq, train only the neurons not at equilibrium (lesson 23);
- ``repurpose``: a trained network split into parallel sub-models, RePurpose (lesson 24);
- ``strads``: scheduled model-parallel coordinate descent for the Lasso (lesson 25);
- ``duality``: parallel branches, weight decay and the nuclear norm: when training is a convex
  problem (lesson 26).
"""

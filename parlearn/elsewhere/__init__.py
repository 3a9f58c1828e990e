"""Part 4 · the same parallel patterns elsewhere in ML (lessons 40-49).

- ``value``: DQN on batched environments, with Episodic Backward Update batched across
  episodes, LS-DQN's batched least-squares head and the t-soft target update (lesson 40);
- ``filters``: a particle filter whose learned measurement update (DMU, reconstructed)
  scores thousands of particles in one batch, beside the exact grid Bayes filter (lesson 41);
- ``nmf``: multiplicative-update NMF (every entry at once) and paired dictionaries for
  spectral conversion (lesson 41).
"""

"""Part 4 · the same parallel patterns elsewhere in ML (lessons 40-49).

- ``filters``: a particle filter whose learned measurement update (DMU, reconstructed)
  scores thousands of particles in one batch, beside the exact grid Bayes filter (lesson 41);
- ``nmf``: multiplicative-update NMF (every entry at once) and paired dictionaries for
  spectral conversion (lesson 41).
"""

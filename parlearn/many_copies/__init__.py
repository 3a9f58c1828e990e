"""Part 3 · many copies at once (lessons 30-39).

- ``dither``: P noisy copies of one example in one batched pass (lesson 30);
- ``qd``, ``rl``: MAP-Elites and PPO on thousands of batched JAX copies (lesson 31);
- ``eigengame``: PCA as a game, sharded over a JAX mesh (lesson 32);
- ``diffusion``, ``decoding``: masked-diffusion LMs and parallel decoders (lesson 33);
- ``replicas``: R replicas trained in one vmapped program and pooled (lesson 34).
"""
